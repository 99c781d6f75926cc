"""KV memory held by long generations under sliding windows, against the same model with global
attention, in one run: the most KV bytes in use across both pools after any step (blocks times
a block's bytes: a hybrid model's block holds one KV group's layers), and the decode rate of each.

    python benches/window_blocks.py [--hybrid] [--window 256] [--requests 8] [--max-tokens 1024]

A random Mistral (``common.SMALL``: hidden 256, 4 layers, 8 heads / 2 KV heads) whose every
layer slides, or with ``--hybrid`` a random Gemma 3 of the same shape and 6 layers, five sliding
to one global (its KV groups: one per layer), each written twice, once with every layer global.
Under the window a request holds about ``window / block_size`` blocks of each sliding layer
however long it runs; with global attention it holds its whole length."""

from __future__ import annotations

import argparse
import json
import shutil
import tempfile
import time
from pathlib import Path

import torch
from common import SMALL, cpu_line, prompts, save_word_tokenizer, warm_up_and_queue


def make_pair(root: Path, window: int, hybrid: bool) -> tuple[Path, Path]:
    from transformers import AutoModelForCausalLM, Gemma3TextConfig, MistralConfig

    if hybrid:
        types = ["sliding_attention"] * 5 + ["full_attention"]
        shape = {**SMALL, "num_hidden_layers": 6, "head_dim": 32}
        cfg = Gemma3TextConfig(
            **shape, max_position_embeddings=4096, sliding_window=window, layer_types=types
        )
        cfg.architectures = ["Gemma3ForCausalLM"]
        overrides = {"layer_types": ["full_attention"] * 6}
    else:
        cfg = MistralConfig(**SMALL, max_position_embeddings=4096, sliding_window=window)
        overrides = {"sliding_window": None}
    torch.manual_seed(0)
    sliding = root / "sliding"
    AutoModelForCausalLM.from_config(cfg).save_pretrained(sliding)
    save_word_tokenizer(sliding, cfg.vocab_size)
    dense = root / "global"
    shutil.copytree(sliding, dense)
    conf = json.loads((dense / "config.json").read_text())
    (dense / "config.json").write_text(json.dumps({**conf, **overrides}))
    return sliding, dense


def run(path: Path, batch: list[list[int]], max_tokens: int, offload: str) -> tuple[int, float]:
    """The most KV bytes in use after any step, and output tokens per second."""
    from neo_rs import LLM

    with LLM(str(path), dtype="bfloat16", offload=offload, num_gpu_blocks=2048, num_cpu_blocks=2048) as llm:
        engine, most = llm.engine, 0
        block_bytes = engine.runner.layout.bytes_per_block()
        warm_up_and_queue(engine, batch, max_tokens)
        sched, start = engine.scheduler, time.perf_counter()
        while engine.has_unfinished():
            engine.step()
            used = sum(sched.num_total_blocks(d) - sched.num_free_blocks(d) for d in ("gpu", "cpu"))
            most = max(most, used)
        return most * block_bytes, len(batch) * max_tokens / (time.perf_counter() - start)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--window", type=int, default=256)
    ap.add_argument("--requests", type=int, default=8)
    ap.add_argument("--max-tokens", type=int, default=1024)
    ap.add_argument("--offload", default="none", choices=["none", "neo", "all"])
    ap.add_argument("--hybrid", action="store_true", help="a Gemma 3 of sliding and global layers")
    args = ap.parse_args()
    print(f"{cpu_line()}, {torch.get_num_threads()} threads")
    batch = prompts(args.requests, 64, 128)
    with tempfile.TemporaryDirectory() as tmp:
        sliding, dense = make_pair(Path(tmp), args.window, args.hybrid)
        held_w, rate_w = run(sliding, batch, args.max_tokens, args.offload)
        held_g, rate_g = run(dense, batch, args.max_tokens, args.offload)
    model = "Gemma 3, 5 sliding : 1 global" if args.hybrid else "Mistral, every layer sliding"
    print(
        f"{model}: {args.requests} requests x {args.max_tokens} tokens, window {args.window}, "
        f"offload {args.offload}"
    )
    print(f"{'':>8} {'most KV MiB held':>17} {'tok/s':>8}")
    print(f"{'window':>8} {held_w / 2**20:>17.1f} {rate_w:>8.1f}")
    print(f"{'global':>8} {held_g / 2**20:>17.1f} {rate_g:>8.1f}")
    print(f"KV held, window / global: {held_w / held_g:.3f}x; decode rate {rate_w / rate_g:.2f}x")


if __name__ == "__main__":
    main()
