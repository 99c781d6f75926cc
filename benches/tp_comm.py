"""Tensor parallelism's cost made visible: the same offline batch on 1 and 2 ranks (gloo on the
CPU), on the ~20M-parameter random Llama (8 heads, 2 KV heads: one per rank). Per iteration,
rank 0's wall time inside the model's collectives (2 all-reduces per layer, the vocab-parallel
embedding's and the logits' gather) next to the step time, and throughput against 1 rank.

On this 2-core machine 2 ranks are not expected to be faster: each gets one core, and every
collective waits for the slower rank. The figures show what the communication costs.

    python benches/tp_comm.py [--prompts 32] [--max-tokens 64] [--offload none]
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

from common import make_model, prompts, warm_up_and_queue
from neo_rs import LLMEngine
from neo_rs.config import EngineArgs


def run(path: Path, tp: int, batch: list[list[int]], args: argparse.Namespace) -> dict[str, float]:
    engine = LLMEngine(
        EngineArgs(
            model=str(path),
            dtype=args.dtype,
            offload=args.offload,
            tensor_parallel_size=tp,
            max_num_seqs=len(batch),
            skip_tokenizer_init=True,
        )
    )
    try:
        group = engine.runner.tp
        warm_up_and_queue(engine, batch, args.max_tokens)
        steps, comms, tokens = [], [], 0
        started = time.perf_counter()
        while engine.has_unfinished():
            comm0, t = group.comm_ms, time.perf_counter()
            outs = engine.step()
            steps.append((time.perf_counter() - t) * 1e3)
            comms.append(group.comm_ms - comm0)
            tokens += len(outs)
        elapsed = time.perf_counter() - started
        return {
            "tok_s": tokens / elapsed,
            "step_ms": statistics.mean(steps),
            "comm_ms": statistics.mean(comms),
            "steps": len(steps),
        }
    finally:
        engine.shutdown()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--prompts", type=int, default=32)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--offload", default="none", choices=["none", "neo", "all"])
    ap.add_argument("--dtype", default="bfloat16")
    args = ap.parse_args()
    batch = prompts(args.prompts, 32, 128)
    with tempfile.TemporaryDirectory() as tmp:
        path = make_model(Path(tmp))
        rows = {tp: run(path, tp, batch, args) for tp in (1, 2)}
    print(f"\n{args.prompts} prompts x {args.max_tokens} tokens, offload={args.offload}, {args.dtype}")
    head = ("ranks", 5), ("tok/s", 8), ("steps", 6), ("step ms", 8), ("comm ms", 8), ("comm share", 10)
    print(" ".join(f"{name:>{width}}" for name, width in head), f"{'vs 1 rank':>9}")
    base = rows[1]["tok_s"]
    for tp, r in rows.items():
        share = r["comm_ms"] / r["step_ms"]
        print(
            f"{tp:>5} {r['tok_s']:>8.1f} {r['steps']:>6.0f} {r['step_ms']:>8.2f} {r['comm_ms']:>8.2f} "
            f"{share:>10.1%} {r['tok_s'] / base:>8.2f}x"
        )


if __name__ == "__main__":
    main()
