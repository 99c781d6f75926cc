"""The Rust bf16 linear for a few rows (``_core.Bf16Linear``, ``PackedLinear.rows_kernel``)
against oneDNN's packed GEMM on the same linear's packed weight, side by side in one process:
each decoder linear of SmolLM2-135M and of Llama-3.2-1B, and SmolLM2's tied LM head, at 1, 2, 4
and 8 rows. Each is timed over enough copies of its weight (random bf16) that every call reads
its weight from memory, as a decode does; the read bandwidth each reaches is printed beside the
machine's (a sum over 1 GiB). ``GEMV_ROWS`` (``model/packed.py``) is where the two cross.
oneDNN computes as the engine's packed linears would here: in bf16 where it has a bf16 GEMM of its
own, else in f32 on a widened copy (``packed.gemm_compute``). ``--path`` times another of the
kernel's paths than this CPU's best, e.g. ``avx2`` beside oneDNN and torch held to AVX2, as on a
CPU without AVX-512:

    python benches/gemv.py [--threads 2] [--rows 1 2 4 8] [--path avx2]
    ONEDNN_MAX_CPU_ISA=AVX2 ATEN_CPU_CAPABILITY=avx2 python benches/gemv.py --path avx2
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
from common import cpu_line
from neo_rs._core import Bf16Linear
from neo_rs.model.packed import PackedLinear, _gemm, bf16_native
from neo_rs.model.rust_linears import gemv_path
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


def compare(k: int, n: int, rows: int, threads: int, path: str) -> tuple[float, float]:
    """oneDNN's and the Rust kernel's microseconds per call, alternating rounds."""
    copies = max(2, COPIES_BYTES // (n * k * 2))
    compute = torch.bfloat16 if bf16_native() else torch.float32
    onednn, rust = [], []
    for _ in range(copies):
        plain = nn.Linear(k, n, bias=False).to(torch.bfloat16)
        packed = PackedLinear(plain, max(rows, 8), gemv_threads=threads, compute=compute)
        packed.gemv = Bf16Linear(plain.weight.detach(), num_threads=threads, path=path)
        onednn.append(lambda x, p=packed: _gemm(x, p.packed, None, p.compute))
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
    ap.add_argument("--path", default=gemv_path(), help="the Rust kernel's path (default: this CPU's best)")
    args = ap.parse_args()
    if args.path == "scalar":
        raise SystemExit("the Rust linear's scalar path is only a reference: this CPU has no SIMD path of it")
    torch.set_num_threads(args.threads)
    print(cpu_line())
    compute = "bf16" if bf16_native() else "f32"
    print(
        f"threads: {args.threads}; memory read bandwidth: {read_gbs():.1f} GB/s; Rust path {args.path}, ",
        end="",
    )
    print(f"oneDNN in {compute} (ISA {torch.backends.cpu.get_cpu_capability()} for torch)")
    print(f"{'shape':<14}{'linear':<14}{'rows':>5}{'oneDNN us':>11}{'Rust us':>10}{'speed-up':>10}", end="")
    print(f"{'oneDNN GB/s':>13}{'Rust GB/s':>11}")
    for name, shape in SHAPES.items():
        table = linears(shape)
        if name.startswith("smollm2"):
            table["lm_head"] = (shape[0], shape[6])
        for lin, (k, n) in table.items():
            for rows in args.rows:
                onednn, rust = compare(k, n, rows, args.threads, args.path)
                gb = n * k * 2 / 1e3
                print(
                    f"{name:<14}{lin:<14}{rows:>5}{onednn:>11.1f}{rust:>10.1f}{onednn / rust:>9.2f}x", end=""
                )
                print(f"{gb / onednn:>13.1f}{gb / rust:>11.1f}")


if __name__ == "__main__":
    main()
