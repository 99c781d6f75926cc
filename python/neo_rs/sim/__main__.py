"""``python -m neo_rs.sim``: will CPU offloading help on this GPU + host, for this model and
workload? Runs the real scheduler in ``neo``, ``none`` and ``all`` modes against the cost model
and prints throughput, latency, the gain and a verdict.

    python -m neo_rs.sim --gpu T4 --host g4dn.4xlarge --model llama-2-7b --workload osc --rate 2
    python -m neo_rs.sim --gpu A10G --host g5.16xlarge --model llama-3-8b --input-len 1000 --output-len 200
"""

from __future__ import annotations

import argparse
import dataclasses
import json
from pathlib import Path

import torch

from neo_rs.bench import workloads
from neo_rs.bench.arrivals import arrival_times
from neo_rs.config import ModelConfig, resolve_dtype
from neo_rs.sim.calibrate import fit, model_profile
from neo_rs.sim.cost import CostModel, Efficiency
from neo_rs.sim.profiles import GPUS, HOSTS, MODELS, WEIGHT_BITS, load_profiles
from neo_rs.sim.simulate import capacity_at_slo, simulate, verdict
from neo_rs.worker.profiler import PerfTables


def _calibrate(args: argparse.Namespace) -> None:
    """Print the efficiency factors that reproduce a measured profile on ``--gpu``/``--host``."""
    if args.model_dir is None:
        raise SystemExit("--calibrate needs --model-dir (the model the profile was taken with)")
    tables = PerfTables.from_json(json.loads(args.calibrate.read_text()))
    cfg = ModelConfig.from_dir(args.model_dir)
    dtype = resolve_dtype(args.dtype, cfg.torch_dtype)
    model = model_profile(cfg, args.model_dir.name, torch.empty((), dtype=dtype).element_size())
    eff = fit(CostModel(GPUS[args.gpu], HOSTS[args.host], model), tables)
    print(json.dumps(dataclasses.asdict(eff), indent=1))


def _equal_latency(cost: CostModel, args: argparse.Namespace, reqs: list[workloads.BenchRequest]) -> None:
    rates = {}
    print(f"{'mode':<6}{'req/s at SLO':>14}{'tok/s':>10}{'ms/token':>10}")
    for mode in args.modes.split(","):
        rate, r = capacity_at_slo(
            cost, mode, reqs, args.slo_ms_per_token, args.seed, args.max_num_seqs, args.max_num_batched_tokens
        )
        rates[mode] = rate
        tput, lat = (r.output_throughput, r.per_token_latency_ms) if r else (0.0, 0.0)
        print(f"{mode:<6}{rate:>14.3f}{tput:>10.1f}{lat:>10.1f}")
    if rates.get("none"):
        print(
            f"neo vs none at {args.slo_ms_per_token:g} ms/token: {rates.get('neo', 0.0) / rates['none']:.2f}x"
        )


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(
        prog="python -m neo_rs.sim", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--profiles", type=Path, help="extra GPU/host/model profiles (JSON or TOML)")
    ap.add_argument("--gpu", default="A10G")
    ap.add_argument("--host", default="g5.4xlarge")
    ap.add_argument("--model", default="llama-3-8b")
    ap.add_argument("--workload", default="synthetic", help="synthetic | osc | azure-code | FILE.jsonl")
    ap.add_argument("--input-len", type=int, default=1000)
    ap.add_argument("--output-len", type=int, default=200)
    ap.add_argument("--num-requests", type=int, default=2000)
    ap.add_argument("--rate", type=float, default=float("inf"), help="requests/s (inf: all at once)")
    ap.add_argument("--modes", default="neo,none,all")
    ap.add_argument("--max-num-seqs", type=int, default=256)
    ap.add_argument("--max-num-batched-tokens", type=int, default=4096)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument(
        "--cpu-kv-dtype",
        default="auto",
        choices=["auto", "int8"],
        help="host pool storage (int8: half the bytes)",
    )
    ap.add_argument(
        "--weights",
        choices=list(WEIGHT_BITS),
        help="the decoder layers' weights quantized (--quantization): fewer bytes on the GPU and per step",
    )
    ap.add_argument("--efficiency", type=Path, help="efficiency factors (JSON, as --calibrate prints)")
    ap.add_argument(
        "--slo-ms-per-token",
        type=float,
        help="instead of one run per mode, the highest Poisson rate each mode sustains within this "
        "mean per-token latency (the paper's equal-latency comparison)",
    )
    ap.add_argument(
        "--calibrate", type=Path, help="fit efficiency factors to this engine profile (JSON); no run"
    )
    ap.add_argument("--model-dir", type=Path, help="with --calibrate: the profiled model's directory")
    ap.add_argument("--dtype", default="auto", help="with --calibrate: the dtype the profile ran in")
    args = ap.parse_args(argv)
    if args.profiles:
        load_profiles(args.profiles)
    if args.calibrate:
        _calibrate(args)
        return
    for kind, name, table in (
        ("gpu", args.gpu, GPUS),
        ("host", args.host, HOSTS),
        ("model", args.model, MODELS),
    ):
        if name not in table:
            ap.error(f"unknown {kind} {name!r} (known: {', '.join(table)})")
    eff = Efficiency(**json.loads(args.efficiency.read_text())) if args.efficiency else Efficiency()
    model = MODELS[args.model]
    if args.weights:
        model = dataclasses.replace(model, weight_bits=WEIGHT_BITS[args.weights])
    cost = CostModel(GPUS[args.gpu], HOSTS[args.host], model, eff, cpu_kv_int8=args.cpu_kv_dtype == "int8")
    reqs = workloads.make(args.workload, args.num_requests, args.input_len, args.output_len, args.seed)
    arrivals = arrival_times(len(reqs), args.rate, 1.0, args.seed)
    weights = f" ({args.weights} weights)" if args.weights else ""
    print(
        f"{args.gpu} + {args.host} + {args.model}{weights}: "
        f"device KV {cost.num_gpu_blocks() * cost.block_size} tokens, "
        f"host KV {cost.num_cpu_blocks() * cost.block_size} tokens; "
        f"{len(reqs)} requests at {args.rate} req/s"
    )
    if args.slo_ms_per_token:
        _equal_latency(cost, args, reqs)
        return
    results = {}
    print(
        f"{'mode':<6}{'tok/s':>10}{'req/s':>8}{'ms/token':>10}{'TTFT ms':>10}{'iters':>8}{'pipelined':>10}"
        f"{'CPU dec':>9}{'sched us/it':>12}"
    )
    for mode in args.modes.split(","):
        r = simulate(cost, mode, reqs, arrivals, args.max_num_seqs, args.max_num_batched_tokens)
        results[mode] = r
        print(
            f"{mode:<6}{r.output_throughput:>10.1f}{r.request_throughput:>8.2f}{r.per_token_latency_ms:>10.1f}"
            f"{r.ttft_ms:>10.0f}{r.iterations:>8}{r.pipelined_share:>10.0%}{r.cpu_decode_share:>9.0%}"
            f"{r.scheduler_us_per_iteration:>12.1f}"
        )
    if "neo" in results and "none" in results and results["none"].output_throughput:
        print(f"neo vs none: {results['neo'].output_throughput / results['none'].output_throughput:.2f}x")
    print(verdict(cost, results))


if __name__ == "__main__":
    main()
