"""The GPU half of ``benches/gpu_check.sh``: a Llama-3-8B-shaped model with random bf16
weights, the device KV pool cut to ~4 GiB, a synthetic workload (input 1000 +- 10%, output
200 +- 10%, all requests at once), ``--offload neo`` against ``none``: throughput and median
per-token latency (request latency / output tokens), one table.

    python benches/gpu_check.py [--requests 96] [--kv-gib 4] [--layers 32]
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path

import torch
from neo_rs import LLMEngine, SamplingParams
from neo_rs.config import EngineArgs
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


def make_model(root: Path, layers: int) -> Path:
    """Random weights written shard per layer (no transformers init: it is slow at this size)."""
    cfg = dict(LLAMA3_8B, num_hidden_layers=layers)
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


def workload(n: int, seed: int = 0) -> list[tuple[list[int], int]]:
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(n):
        lin = int(torch.randint(900, 1101, (1,), generator=g))
        lout = int(torch.randint(180, 221, (1,), generator=g))
        out.append((torch.randint(10, 128000, (lin,), generator=g).tolist(), lout))
    return out


def run(
    path: Path, mode: str, reqs: list[tuple[list[int], int]], args: argparse.Namespace
) -> dict[str, float]:
    block_bytes = 2 * LLAMA3_8B["num_key_value_heads"] * 128 * 16 * 2  # per layer
    layers = json.loads((path / "config.json").read_text())["num_hidden_layers"]
    engine = LLMEngine(
        EngineArgs(
            model=str(path),
            dtype="bfloat16",
            offload=mode,
            max_num_seqs=256,
            max_num_batched_tokens=args.budget,
            num_gpu_blocks=int(args.kv_gib * (1 << 30)) // (block_bytes * layers),
            cpu_kv_gib=args.cpu_gib,
            skip_tokenizer_init=True,
        )
    )
    start = time.perf_counter()
    for prompt, n in reqs:
        engine.add_request(prompt, SamplingParams(temperature=0, max_tokens=n, ignore_eos=True))
    per_token, tokens, modes = [], 0, {"gpu-only": 0, "sequential": 0, "pipelined": 0}
    while engine.has_unfinished():
        for o in engine.step():
            if o.finished:
                n = len(o.outputs[0].token_ids)
                tokens += n
                per_token.append((time.perf_counter() - start) / n * 1e3)
        assert engine.last_stats is not None
        modes[engine.last_stats.mode] += 1
    elapsed = time.perf_counter() - start
    return {"tok_s": tokens / elapsed, "ms_per_token": statistics.median(per_token), **modes}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--requests", type=int, default=96)
    ap.add_argument("--kv-gib", type=float, default=4.0)
    ap.add_argument("--cpu-gib", type=float, default=48.0)
    ap.add_argument("--layers", type=int, default=32)
    ap.add_argument("--budget", type=int, default=4096, help="max_num_batched_tokens")
    args = ap.parse_args()
    reqs = workload(args.requests)
    with tempfile.TemporaryDirectory(dir="/tmp") as tmp:
        t = time.perf_counter()
        path = make_model(Path(tmp), args.layers)
        print(
            f"random Llama-3-8B-shaped checkpoint ({args.layers} layers) in {time.perf_counter() - t:.0f} s",
            flush=True,
        )
        results = {mode: run(path, mode, reqs, args) for mode in ("none", "neo")}
    base = results["none"]["tok_s"]
    name = torch.cuda.get_device_name() if torch.cuda.is_available() else "CPU (smoke run)"
    print(f"{name}, {args.requests} requests, device KV {args.kv_gib} GiB")
    print(
        f"{'mode':<6}{'tok/s':>9}{'vs none':>9}{'median ms/token':>17}"
        "  iterations gpu-only/sequential/pipelined"
    )
    for mode, r in results.items():
        mix = f"{r['gpu-only']:.0f}/{r['sequential']:.0f}/{r['pipelined']:.0f}"
        print(f"{mode:<6}{r['tok_s']:>9.1f}{r['tok_s'] / base:>8.2f}x{r['ms_per_token']:>17.1f}  {mix}")


if __name__ == "__main__":
    main()
