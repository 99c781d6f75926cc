"""oneDNN's bf16 GEMM on a weight packed for one row against the same weight packed for two
(``PackedLinear`` packs for ``max(rows, 2)``), side by side in one process: each decoder linear of
SmolLM2-135M and of Llama-3.2-1B, called with 1, 5, 64 and 512 rows (a decode, a decode
verifying four drafts, a batch, a prefill chunk). Each is timed over enough copies of its weight
that every call reads its weight from memory, as a decode does; rounds alternate.

    python benches/pack_rows.py [--threads 2] [--rows 1 5 64 512]
"""

from __future__ import annotations

import argparse
import statistics

import torch
from common import cpu_line
from gemv import COPIES_BYTES, per_call_us
from quant_linear import SHAPES, linears


def linear_call(packed: torch.Tensor):  # noqa: ANN201
    """oneDNN's GEMM on ``packed``, as ``gemv.per_call_us`` calls it."""
    return lambda x: torch.ops.mkldnn._linear_pointwise(x, packed, None, "none", [], "")


def compare(k: int, n: int, rows: int) -> tuple[float, float]:
    """Microseconds per call on the weight packed for one row and for two, alternating rounds."""
    weights = [torch.randn(n, k).bfloat16() for _ in range(max(2, COPIES_BYTES // (n * k * 2)))]
    reorder = torch.ops.mkldnn._reorder_linear_weight
    one, two = ([linear_call(reorder(w, hint)) for w in weights] for hint in (1, 2))
    x = torch.randn(rows, k).bfloat16()
    a, b = [], []
    for _ in range(3):
        a.append(per_call_us(one, x))
        b.append(per_call_us(two, x))
    return statistics.median(a), statistics.median(b)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 5, 64, 512])
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    print(f"{cpu_line()}; threads: {args.threads}")
    print(f"{'shape':<14}{'linear':<14}{'rows':>5}{'for 1 us':>10}{'for 2 us':>10}{'1 / 2':>8}")
    for name, shape in SHAPES.items():
        for lin, (k, n) in linears(shape).items():
            for rows in args.rows:
                one, two = compare(k, n, rows)
                print(f"{name:<14}{lin:<14}{rows:>5}{one:>10.1f}{two:>10.1f}{one / two:>7.2f}x")


if __name__ == "__main__":
    main()
