"""KV blocks held by long generations under a sliding window on every layer (Mistral v0.1
style), against the same model with global attention, in one run: the most blocks in use across
both pools after any step, and the decode rate of each.

    python benches/window_blocks.py [--window 256] [--requests 8] [--max-tokens 1024]

A random Mistral (``common.SMALL``: hidden 256, 4 layers, 8 heads / 2 KV heads) written twice,
once without its window. Under the window a request holds about ``window / block_size`` blocks
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


def make_pair(root: Path, window: int) -> tuple[Path, Path]:
    from transformers import MistralConfig, MistralForCausalLM

    cfg = MistralConfig(**SMALL, max_position_embeddings=4096, sliding_window=window)
    torch.manual_seed(0)
    sliding = root / "mistral-sliding"
    MistralForCausalLM(cfg).save_pretrained(sliding)
    save_word_tokenizer(sliding, cfg.vocab_size)
    dense = root / "mistral-global"
    shutil.copytree(sliding, dense)
    conf = json.loads((dense / "config.json").read_text())
    (dense / "config.json").write_text(json.dumps({**conf, "sliding_window": None}))
    return sliding, dense


def run(path: Path, batch: list[list[int]], max_tokens: int, offload: str) -> tuple[int, float]:
    """The most blocks in use after any step, and output tokens per second."""
    from neo_rs import LLM

    with LLM(str(path), dtype="bfloat16", offload=offload, num_gpu_blocks=2048, num_cpu_blocks=2048) as llm:
        engine, most = llm.engine, 0
        warm_up_and_queue(engine, batch, max_tokens)
        sched, start = engine.scheduler, time.perf_counter()
        while engine.has_unfinished():
            engine.step()
            used = sum(sched.num_total_blocks(d) - sched.num_free_blocks(d) for d in ("gpu", "cpu"))
            most = max(most, used)
        return most, len(batch) * max_tokens / (time.perf_counter() - start)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--window", type=int, default=256)
    ap.add_argument("--requests", type=int, default=8)
    ap.add_argument("--max-tokens", type=int, default=1024)
    ap.add_argument("--offload", default="none", choices=["none", "neo", "all"])
    args = ap.parse_args()
    print(f"{cpu_line()}, {torch.get_num_threads()} threads")
    batch = prompts(args.requests, 64, 128)
    with tempfile.TemporaryDirectory() as tmp:
        sliding, dense = make_pair(Path(tmp), args.window)
        held_w, rate_w = run(sliding, batch, args.max_tokens, args.offload)
        held_g, rate_g = run(dense, batch, args.max_tokens, args.offload)
    print(
        f"{args.requests} requests x {args.max_tokens} tokens, window {args.window}, offload {args.offload}"
    )
    print(f"{'':>8} {'most blocks held':>17} {'tok/s':>8}")
    print(f"{'window':>8} {held_w:>17} {rate_w:>8.1f}")
    print(f"{'global':>8} {held_g:>17} {rate_g:>8.1f}")
    print(f"blocks held, window / global: {held_w / held_g:.3f}x; decode rate {rate_w / rate_g:.2f}x")


if __name__ == "__main__":
    main()
