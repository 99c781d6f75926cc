"""What the packed CPU linears compute batches in (``model/packed.py``, ``NEO_RS_CPU_GEMM``):
oneDNN's GEMM on the bf16 weight against the same on a widened f32 copy (input widened, output
narrowed), ``PackedLinear`` itself without the Rust kernel, side by side in one process, for each
decoder linear of SmolLM2-135M and its tied LM head, at batch sizes from 16 rows (below them the
Rust kernel takes one stream's rows) to a prefill chunk's. It prints each ratio, a decode step's
linears (every layer's and the head's), the start-up probe's figure (``float32_speedup``) and what
``auto`` picks for SmolLM2 on this machine.

    python benches/cpu_gemm.py [--threads 2] [--rows 16 32 64 128 512]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
from common import cpu_line
from neo_rs.model.packed import PackedLinear, float32_speedup, gemm_compute
from quant_linear import SHAPES, linears
from torch import nn

DTYPES = (torch.bfloat16, torch.float32)


def per_call_ms(call, x: torch.Tensor, reps: int) -> float:  # noqa: ANN001 (a callable)
    call(x)
    t = time.perf_counter()
    for _ in range(reps):
        call(x)
    return (time.perf_counter() - t) * 1e3 / reps


def compare(k: int, n: int, rows: int) -> dict[torch.dtype, float]:
    """Milliseconds per call in each compute dtype: the median of alternating rounds."""
    plain = nn.Linear(k, n, bias=False).to(torch.bfloat16)
    x = torch.randn(rows, k).to(torch.bfloat16)
    calls = {dtype: PackedLinear(plain, rows, compute=dtype).linear for dtype in DTYPES}
    reps = max(3, int(2e8 // (rows * k * n)))  # about 0.4 GFLOP a round
    times: dict[torch.dtype, list[float]] = {d: [] for d in DTYPES}
    for _ in range(5):
        for dtype, call in calls.items():
            times[dtype].append(per_call_ms(call, x, reps))
    return {d: statistics.median(t) for d, t in times.items()}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--rows", type=int, nargs="+", default=[16, 32, 64, 128, 512])
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    print(cpu_line())
    shape = SHAPES["smollm2-135m"]
    table = linears(shape) | {"lm_head": (shape[0], shape[6])}
    print(f"threads: {args.threads}; SmolLM2-135M's linears, ms per call, bf16 / f32 (speed-up of f32)")
    print(f"{'rows':>5}  " + "".join(f"{name:>24}" for name in table) + f"{'a step':>24}")
    for rows in args.rows:
        step = dict.fromkeys(DTYPES, 0.0)
        cells = []
        for name, (k, n) in table.items():
            ms = compare(k, n, rows)
            per_step = 1 if name == "lm_head" else shape[5]  # the head once, each decoder linear per layer
            for d in DTYPES:
                step[d] += ms[d] * per_step
            bf16, f32 = ms[torch.bfloat16], ms[torch.float32]
            cells.append(f"{bf16:.3f}/{f32:.3f} ({bf16 / f32:.2f}x)")
        bf16, f32 = step[torch.bfloat16], step[torch.float32]
        total = f"{bf16:.1f}/{f32:.1f} ({bf16 / f32:.2f}x)"
        print(f"{rows:>5}  " + "".join(f"{c:>24}" for c in cells) + f"{total:>24}")
    weight_bytes = sum(k * n * 2 * (1 if name == "lm_head" else shape[5]) for name, (k, n) in table.items())
    print(f"start-up probe (float32_speedup): {float32_speedup(args.threads):.2f}x; ", end="")
    print(f"auto picks {gemm_compute(weight_bytes)} for SmolLM2 here")


if __name__ == "__main__":
    main()
