"""Random draws on a CPU device: torch's (``sampling.draw_in_torch``, the CUDA path: divide,
sort-based top-k/top-p, min-p, softmax, cumsum, search) against the Rust sampler
(``sampling.draw_on_cpu``, ``_core.Categorical``), side by side in one process, alternating
rounds, on SmolLM2's vocabulary (49,152 random float32 logits a row) at temperature 1.0, and with
half the rows narrowed by top-p 0.9 (random logits make the nucleus wide: a worst case for both).

    python benches/sampling.py [--threads 2] [--rows 1 16 64]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
from common import cpu_line
from neo_rs.sample.sampling import SamplingParams, draw_in_torch, draw_on_cpu

VOCAB = 49152


def per_step_ms(draw, logits: torch.Tensor, params: list[SamplingParams]) -> float:  # noqa: ANN001
    rows = list(range(len(params)))
    u = torch.rand(len(rows), 1)
    t = time.perf_counter()
    for _ in range(10):
        draw(logits, rows, params, u)
    return (time.perf_counter() - t) * 1e2


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 16, 64])
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    print(cpu_line(), f"{args.threads} threads")
    print(f"{'rows':>5} {'top-p rows':>11} {'torch ms':>9} {'rust ms':>8} {'speed-up':>9}")
    for n in args.rows:
        logits = torch.randn(n, VOCAB) * 3
        for narrowed in sorted({0, n // 2}):
            params = [SamplingParams(top_p=0.9 if i < narrowed else 1.0) for i in range(n)]
            times: dict[str, list[float]] = {"torch": [], "rust": []}
            for _ in range(5):
                times["torch"].append(per_step_ms(draw_in_torch, logits, params))
                times["rust"].append(per_step_ms(draw_on_cpu, logits, params))
            a, b = (statistics.median(t[1:]) for t in times.values())
            print(f"{n:>5} {narrowed:>11} {a:>9.2f} {b:>8.2f} {a / b:>8.2f}x")


if __name__ == "__main__":
    main()
