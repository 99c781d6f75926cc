"""The Rust bf16 linear for a few rows (``_core.Bf16Linear``, ``PackedLinear.rows_kernel``)
against oneDNN's packed GEMM on the same linear's packed weight, side by side in one process:
each decoder linear of SmolLM2-135M and of Llama-3.2-1B, and SmolLM2's tied LM head, at 1, 2, 4
and 8 rows. Each is timed over enough copies of its weight (random bf16) that every call reads
its weight from memory, as a decode does; the read bandwidth each reaches is printed beside the
machine's (a sum over 1 GiB). ``GEMV_ROWS`` (``model/packed.py``) is where the two cross.

    python benches/gemv.py [--threads 2] [--rows 1 2 4 8]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
from common import cpu_line
from neo_rs.model.packed import PackedLinear
from neo_rs.model.rust_linears import gemv_applies
from quant_linear import SHAPES, linears, read_gbs
from torch import nn

COPIES_BYTES = 256 << 20  # past any last-level cache of ours


def per_call_us(calls: list, x: torch.Tensor) -> float:  # noqa: ANN001 (callables)
    """Median over rounds of a pass through every copy, per call."""
    times = []
    for _ in range(5):
        t = time.perf_counter()
        for call in calls:
            call(x)
        times.append((time.perf_counter() - t) * 1e6 / len(calls))
    return statistics.median(times[1:])


def compare(k: int, n: int, rows: int, threads: int) -> tuple[float, float]:
    """oneDNN's and the Rust kernel's microseconds per call, alternating rounds."""
    copies = max(2, COPIES_BYTES // (n * k * 2))
    onednn, rust = [], []
    for _ in range(copies):
        packed = PackedLinear(
            nn.Linear(k, n, bias=False).to(torch.bfloat16), max(rows, 8), gemv_threads=threads
        )
        onednn.append(
            lambda x, p=packed: torch.ops.mkldnn._linear_pointwise(x, p.packed, None, "none", [], "")
        )
        rust.append(packed.rows_kernel)
    x = torch.randn(rows, k, dtype=torch.bfloat16)
    a, b = [], []
    for _ in range(3):
        a.append(per_call_us(onednn, x))
        b.append(per_call_us(rust, x))
    return statistics.median(a), statistics.median(b)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 2, 4, 8])
    args = ap.parse_args()
    if not gemv_applies():
        raise SystemExit("the Rust linear needs AVX512_BF16 (its scalar path is only a reference)")
    torch.set_num_threads(args.threads)
    print(cpu_line())
    print(f"threads: {args.threads}; memory read bandwidth: {read_gbs():.1f} GB/s")
    print(f"{'shape':<14}{'linear':<14}{'rows':>5}{'oneDNN us':>11}{'Rust us':>10}{'speed-up':>10}", end="")
    print(f"{'oneDNN GB/s':>13}{'Rust GB/s':>11}")
    for name, shape in SHAPES.items():
        table = linears(shape)
        if name.startswith("smollm2"):
            table["lm_head"] = (shape[0], shape[6])
        for lin, (k, n) in table.items():
            for rows in args.rows:
                onednn, rust = compare(k, n, rows, args.threads)
                gb = n * k * 2 / 1e3
                print(
                    f"{name:<14}{lin:<14}{rows:>5}{onednn:>11.1f}{rust:>10.1f}{onednn / rust:>9.2f}x", end=""
                )
                print(f"{gb / onednn:>13.1f}{gb / rust:>11.1f}")


if __name__ == "__main__":
    main()
