"""The GPU half of ``benches/gpu_check.sh``: a Llama-3-8B-shaped model with random bf16
weights, the device KV pool cut so that ``none`` must queue, a synthetic workload (input
1000 +- 10%, output 200 +- 10%, all requests at once), ``--offload neo`` against ``none``, each
mode in a process of its own and warmed up there first (on the first H200 run, with both in one
process, whichever engine ran second was 1.8x faster than the first):
throughput, median per-token latency (request latency / output tokens), the iteration mix, and
the share of CPU attention hidden under device work. Before the workload each mode runs its worst
iteration (``max_num_seqs`` prompts filling the token budget) and holds the allocator's peak
against the activation plan traced on fake tensors (``neo_rs/worker/memory_plan.py``). Writes
``gpu_check.json``, the start-up perf profile (``profile.json``) and the model's ``config.json``
(together the input of ``python -m neo_rs.sim --calibrate``) under ``--out``.

    python benches/gpu_check.py --out DIR [--requests 96] [--kv-share 0.3] [--layers 32]
    python benches/gpu_check.py --out DIR --smoke     # a tiny shape, one layer, on any device
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
from neo_rs import LLMEngine, SamplingParams
from neo_rs.config import EngineArgs
from neo_rs.environment import cache_dir
from neo_rs.worker.memory_plan import WORST_ROW, MemoryPlanError
from neo_rs.worker.profiler import profile_key
from safetensors.torch import save_file

LLAMA3_8B = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "vocab_size": 128256,
    "hidden_size": 4096,
    "intermediate_size": 14336,
    "num_hidden_layers": 32,
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "max_position_embeddings": 8192,
    "rms_norm_eps": 1e-5,
    "rope_theta": 500000.0,
    "torch_dtype": "bfloat16",
}
# --smoke: the same code paths at a size any CPU runs in seconds.
TINY = dict(
    LLAMA3_8B,
    vocab_size=1024,
    hidden_size=256,
    intermediate_size=512,
    num_attention_heads=8,
    num_key_value_heads=2,
)


def make_model(root: Path, shape: dict, layers: int) -> Path:
    """Random weights written shard per layer (no transformers init: it is slow at this size)."""
    cfg = dict(shape, num_hidden_layers=layers)
    path = root / "llama3-8b-random"
    path.mkdir()
    (path / "config.json").write_text(json.dumps(cfg))
    h, f, v = cfg["hidden_size"], cfg["intermediate_size"], cfg["vocab_size"]
    kv = cfg["num_key_value_heads"] * h // cfg["num_attention_heads"]
    dev = "cuda" if torch.cuda.is_available() else "cpu"  # cpu: a smoke run of the script itself
    g = torch.Generator(device=dev).manual_seed(0)

    def rand(*shape: int) -> torch.Tensor:
        return (torch.randn(*shape, generator=g, device=dev, dtype=torch.bfloat16) * 0.02).cpu()

    weight_map = {}
    shards = [
        {"model.embed_tokens.weight": rand(v, h), "model.norm.weight": torch.ones(h, dtype=torch.bfloat16)}
    ]
    shards[0]["lm_head.weight"] = rand(v, h)
    for i in range(layers):
        p = f"model.layers.{i}."
        shards.append(
            {
                p + "self_attn.q_proj.weight": rand(h, h),
                p + "self_attn.k_proj.weight": rand(kv, h),
                p + "self_attn.v_proj.weight": rand(kv, h),
                p + "self_attn.o_proj.weight": rand(h, h),
                p + "mlp.gate_proj.weight": rand(f, h),
                p + "mlp.up_proj.weight": rand(f, h),
                p + "mlp.down_proj.weight": rand(h, f),
                p + "input_layernorm.weight": torch.ones(h, dtype=torch.bfloat16),
                p + "post_attention_layernorm.weight": torch.ones(h, dtype=torch.bfloat16),
            }
        )
    for n, shard in enumerate(shards):
        name = f"model-{n:05d}.safetensors"
        save_file(shard, str(path / name), metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(shard, name))
    (path / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    return path


def workload(
    n: int, input_len: int, output_len: int, vocab: int, seed: int = 0
) -> list[tuple[list[int], int]]:
    """``n`` prompts of ``input_len`` +- 10% random tokens, each asking ``output_len`` +- 10%."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(n):
        lin = int(torch.randint(input_len * 9 // 10, input_len * 11 // 10 + 1, (1,), generator=g))
        lout = int(torch.randint(output_len * 9 // 10, output_len * 11 // 10 + 1, (1,), generator=g))
        out.append((torch.randint(10, vocab, (lin,), generator=g).tolist(), lout))
    return out


def worst_iteration_memory(engine: LLMEngine, budget: int) -> dict | None:
    """The activation plan held against the allocator: ``max_num_seqs`` prompts filling the token
    budget, every row sampled the plan's worst way, their first iteration's peak beyond what was
    allocated before (weights and pools). None on a CPU device (no plan there)."""
    plan = engine.runner.activation_plan
    if plan is None:
        return None
    seqs = engine.max_num_seqs
    for i in range(seqs):
        engine.add_request([10 + i] * (budget // seqs), dataclasses.replace(WORST_ROW, max_tokens=1))
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    engine.step()
    torch.cuda.synchronize()
    measured = torch.cuda.max_memory_allocated() - before
    while engine.has_unfinished():
        engine.step()
    try:
        plan.check(measured)
        fits = True
    except MemoryPlanError as e:
        print(e, flush=True)
        fits = False
    return {"traced": plan.peak_bytes, "measured": measured, "reserve": plan.reserve_bytes, "fits": fits}


def run(path: Path, mode: str, reqs: list[tuple[list[int], int]], args: argparse.Namespace) -> dict:
    # The device pool holds a share of the workload's tokens (so `none` must queue and `neo` has
    # host work at any layer count; a fixed size in GiB held a whole 8-layer workload).
    num_gpu_blocks = max(1, int(args.kv_share * sum(len(p) + n for p, n in reqs)) // 16)
    engine = LLMEngine(
        EngineArgs(
            model=str(path),
            dtype="bfloat16",
            offload=mode,
            max_num_seqs=256,
            max_num_batched_tokens=args.budget,
            num_gpu_blocks=num_gpu_blocks,
            cpu_kv_gib=args.cpu_gib,
            skip_tokenizer_init=True,
            cuda_graphs=args.cuda_graphs,
        )
    )
    memory = worst_iteration_memory(engine, args.budget)
    for prompt, _ in reqs[:4]:  # untimed: compiles and plans for prefill and decode shapes
        engine.add_request(prompt, SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))
    while engine.has_unfinished():
        engine.step()
    start = time.perf_counter()
    for prompt, n in reqs:
        engine.add_request(prompt, SamplingParams(temperature=0, max_tokens=n, ignore_eos=True))
    per_token, tokens, modes = [], 0, {"gpu-only": 0, "sequential": 0, "pipelined": 0}
    moved = {"cpu_decodes": 0, "swapped_out_blocks": 0, "swapped_in_blocks": 0, "recomputed": 0}
    cpu_attn_ms = cpu_wait_ms = 0.0
    while engine.has_unfinished():
        for o in engine.step():
            if o.finished:
                n = len(o.outputs[0].token_ids)
                tokens += n
                per_token.append((time.perf_counter() - start) / n * 1e3)
        stats = engine.last_stats
        assert stats is not None
        modes[stats.mode] += 1
        for key in moved:
            moved[key] += getattr(stats, "num_" + key)
        if stats.mode == "pipelined":
            times = engine.runner.last_times
            cpu_attn_ms += sum(times.cpu_attn_ms)
            cpu_wait_ms += times.cpu_wait_ms
    elapsed = time.perf_counter() - start
    hidden = 1 - cpu_wait_ms / cpu_attn_ms if cpu_attn_ms else None
    result = {
        "tok_s": tokens / elapsed,
        "ms_per_token": statistics.median(per_token),
        "hidden": hidden,
        **modes,
        **moved,
    }
    if memory is not None:
        result["memory"] = memory
    if mode == "neo":
        profile = cache_dir() / "profiles" / f"{profile_key(engine.runner, args.budget)}.json"
        result["profile"] = str(profile)
    return result


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, required=True, help="where the JSON, profile and config go")
    ap.add_argument("--smoke", action="store_true", help="a tiny one-layer shape (checks the script)")
    ap.add_argument("--requests", type=int, default=96)
    ap.add_argument("--kv-share", type=float, default=0.3, help="device KV, as a share of the workload's")
    ap.add_argument("--cpu-gib", type=float, default=48.0)
    ap.add_argument("--layers", type=int, default=32)
    ap.add_argument("--modes", default="none,neo", help="each in a fresh process, in this order")
    ap.add_argument("--budget", type=int, default=4096, help="max_num_batched_tokens")
    ap.add_argument("--cuda-graphs", action="store_true", help="both modes with decode graphs")
    ap.add_argument("--child", nargs=3, metavar=("MODE", "MODEL_DIR", "RESULT"), help=argparse.SUPPRESS)
    args = ap.parse_args()
    if sorted(args.modes.split(",")) != ["neo", "none"]:
        ap.error("--modes names none and neo, each once (the table compares them)")
    shape, input_len, output_len = LLAMA3_8B, 1000, 200
    if args.smoke:
        shape, input_len, output_len = TINY, 64, 16
        # 16 device blocks: room for 3 of the 8 requests, so none queues and neo offloads.
        args.requests, args.layers, args.kv_share, args.cpu_gib, args.budget = 8, 1, 0.4, 0.05, 256
    reqs = workload(args.requests, input_len, output_len, shape["vocab_size"])
    if args.child:
        mode, model_dir, result = args.child
        Path(result).write_text(json.dumps(run(Path(model_dir), mode, reqs, args)))
        return
    args.out.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir="/tmp") as tmp:
        t = time.perf_counter()
        path = make_model(Path(tmp), shape, args.layers)
        print(f"random checkpoint ({args.layers} layers) in {time.perf_counter() - t:.0f} s", flush=True)
        results = {}
        for mode in args.modes.split(","):
            result = Path(tmp) / f"{mode}.json"
            cmd = [sys.executable, __file__, *sys.argv[1:], "--child", mode, str(path), str(result)]
            subprocess.run(cmd, check=True)
            results[mode] = json.loads(result.read_text())
        (args.out / "model").mkdir(exist_ok=True)
        shutil.copy(path / "config.json", args.out / "model" / "config.json")
    shutil.copy(results["neo"].pop("profile"), args.out / "profile.json")
    name = torch.cuda.get_device_name() if torch.cuda.is_available() else "CPU"
    summary = {
        "device": name,
        "cuda_graphs": args.cuda_graphs,
        "requests": args.requests,
        "kv_share": args.kv_share,
        "layers": args.layers,
        **results,
    }
    (args.out / "gpu_check.json").write_text(json.dumps(summary, indent=2))
    base = results["none"]["tok_s"]
    graphs = ", decode iterations from CUDA graphs" if args.cuda_graphs else ""
    load = f"{args.requests} requests, device KV {args.kv_share:.0%} of theirs"
    print(f"{name}, {load}, {args.layers} layers{graphs}")
    columns = f"{'mode':<6}{'tok/s':>9}{'vs none':>9}{'p50 ms/token':>14}{'CPU attn hidden':>17}"
    print(columns + "  iterations gpu-only/sequential/pipelined  CPU decodes  blocks out/in  recomputed")
    for mode, r in results.items():
        mix = f"{r['gpu-only']}/{r['sequential']}/{r['pipelined']}"
        hidden = "-" if r["hidden"] is None else f"{r['hidden']:.0%}"
        speed = f"{r['tok_s']:>9.1f}{r['tok_s'] / base:>8.2f}x{r['ms_per_token']:>14.1f}"
        blocks = f"{r['swapped_out_blocks']}/{r['swapped_in_blocks']}"
        print(
            f"{mode:<6}{speed}{hidden:>17}  {mix:>34}{r['cpu_decodes']:>13}{blocks:>15}{r['recomputed']:>12}"
        )
    mib = 1 << 20
    for mode, r in results.items():
        if "memory" in r:
            m = r["memory"]
            verdict = "within" if m["fits"] else "OVER"
            print(
                f"memory plan ({mode}): worst iteration {m['measured'] / mib:.0f} MiB measured, "
                f"{m['traced'] / mib:.0f} MiB traced on fake tensors, {m['reserve'] / mib:.0f} MiB "
                f"reserved: {verdict} the plan"
            )
    print(
        f"calibrate the simulator: python -m neo_rs.sim --calibrate {args.out}/profile.json "
        f"--model-dir {args.out}/model --dtype bfloat16"
    )
    if any(not r.get("memory", {}).get("fits", True) for r in results.values()):
        sys.exit("an iteration took more device memory than its plan keeps")


if __name__ == "__main__":
    main()
