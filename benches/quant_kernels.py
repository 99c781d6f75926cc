"""Our int8/int4 kernel (``_core.QuantGemm``) against what the engine runs instead where it does not
apply, side by side in one process, each decoder linear of SmolLM2-135M and of Llama-3.2-1B at 1,
4, 16 and 64 rows (activations in the model's dtype, bf16 by default; random weights; median of 3
x 20 calls, best of two alternating rounds):

- int8 per output row against torch's ``_weight_int8pack_mm``;
- int4 in groups of 32 (a GGUF's Q4_0 and Q4_1) against torch's ``_weight_int4pack_mm_for_cpu``;
- grouped int8 in groups of 32 (Q8_0) against the GEMM on the weight dequantized, as the engine
  keeps it where our kernel does not run grouped int8: in bf16, oneDNN's packed GEMM (in the
  dtype ``packed.gemm_compute`` picks, f32 where oneDNN has no bf16 GEMM of its own; the Rust
  bf16 kernel for a few rows); in float32 or float16, ``F.linear``.

``--path`` times another of the kernel's paths than this CPU's best, e.g. ``avx2`` beside oneDNN
and torch held to AVX2, as on a CPU without AVX-512; ``--dtype float32`` (or ``float16``) a model
in that dtype (on the AVX512_BF16 path, its kernel in f32 lanes):

    python benches/quant_kernels.py [--threads 2] [--rows 1 4 16 64] [--path avx2] [--dtype float32]
    ONEDNN_MAX_CPU_ISA=AVX2 ATEN_CPU_CAPABILITY=avx2 MKL_ENABLE_INSTRUCTIONS=AVX2 \\
        python benches/quant_kernels.py --path avx2
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable

import torch
from common import cpu_line
from neo_rs._core import Bf16Linear, QuantGemm
from neo_rs.model.packed import PackedLinear, gemm_compute
from neo_rs.model.quant import groups_by_block, pack_int4, pack_int8, quantize_int4, quantize_int8
from neo_rs.model.rust_linears import gemv_path
from quant_linear import SHAPES, linears
from torch import nn

GROUP = 32


def median_ms(fn: Callable[[], object]) -> float:
    for _ in range(3):
        fn()
    times = []
    for _ in range(3):
        t = time.perf_counter()
        for _ in range(20):
            fn()
        times.append((time.perf_counter() - t) / 20 * 1e3)
    return statistics.median(times)


def ours(gemm: QuantGemm, x: torch.Tensor, n: int) -> Callable[[], object]:
    out = torch.empty(x.shape[0], n, dtype=x.dtype)
    return lambda: gemm.forward(x, out)


def kernels(dense: nn.Linear, threads: int, path: str) -> dict[str, tuple[Callable, Callable]]:
    """Per format, (theirs, ours) as functions of ``x``, in ``dense``'s dtype."""
    n, k, dtype = dense.out_features, dense.in_features, dense.weight.dtype
    q8, scale8 = quantize_int8(dense.weight)
    scales = scale8.to(dtype)
    int8 = QuantGemm.int8(pack_int8(q8), scales, n=n, k=k, num_threads=threads, path=path)
    q4, scale4, zero4 = quantize_int4(dense.weight, GROUP)
    sz = torch.stack([scale4, zero4], dim=-1).transpose(0, 1).contiguous().to(dtype)
    int4 = QuantGemm.grouped(
        pack_int4(q4), groups_by_block(sz, n), n=n, k=k, group=GROUP, bits=4, num_threads=threads, path=path
    )
    tinygemm = torch._convert_weight_to_int4pack_for_cpu(q4, 1)
    # Grouped int8: int8 values by a scale per group, zeros 0 (Q8_0).
    sz8 = torch.stack([scale4 * 8, torch.zeros_like(scale4)], dim=-1).transpose(0, 1).contiguous()
    grouped = QuantGemm.grouped(
        pack_int8(q8),
        groups_by_block(sz8.to(dtype), n),
        n=n,
        k=k,
        group=GROUP,
        bits=8,
        num_threads=threads,
        path=path,
    )
    if dtype == torch.bfloat16:
        compute = gemm_compute(dense.weight.numel() * 2) or torch.bfloat16
        dequantized: Callable = PackedLinear(dense, 64, gemv_threads=threads, compute=compute)
        dequantized.gemv = Bf16Linear(dense.weight.detach(), num_threads=threads, path=path)
    else:
        dequantized = dense
    return {
        "int8": (lambda x: lambda: torch._weight_int8pack_mm(x, q8, scales), lambda x: ours(int8, x, n)),
        "int4/32": (
            lambda x: lambda: torch._weight_int4pack_mm_for_cpu(x, tinygemm, GROUP, sz),
            lambda x: ours(int4, x, n),
        ),
        "g8/32": (lambda x: lambda: dequantized(x), lambda x: ours(grouped, x, n)),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 4, 16, 64])
    ap.add_argument("--path", default=None, help="the kernel's path (default: this CPU's best)")
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    dtype = getattr(torch, args.dtype)
    path = args.path or gemv_path()
    print(cpu_line())
    capability, onednn_bf16 = (
        torch.backends.cpu.get_cpu_capability(),
        torch.ops.mkldnn._is_mkldnn_bf16_supported(),
    )
    print(
        f"{args.dtype}; threads {args.threads}; our path {path}; torch's CPU capability {capability}, "
        f"oneDNN bf16 {onednn_bf16}"
    )
    formats = ("int8", "int4/32", "g8/32")
    print(
        f"{'shape':<14}{'linear':<14}{'rows':>5}"
        + "".join(f"{f + ' theirs':>15}{'ours':>8}{'ratio':>7}" for f in formats)
    )
    torch.manual_seed(0)
    with torch.inference_mode():
        for name, shape in SHAPES.items():
            for lin, (k, n) in linears(shape).items():
                dense = nn.Linear(k, n, bias=False).to(dtype)
                nn.init.normal_(dense.weight, std=0.02)
                pairs = kernels(dense, args.threads, path)
                for rows in args.rows:
                    x = torch.randn(rows, k).to(dtype)
                    cells = ""
                    for fmt in formats:
                        theirs, mine = (f(x) for f in pairs[fmt])
                        t = [(median_ms(theirs), median_ms(mine)) for _ in range(2)]
                        a, b = min(r[0] for r in t), min(r[1] for r in t)
                        cells += f"{a:>15.3f}{b:>8.3f}{b / a:>6.2f}x"
                    print(f"{name:<14}{lin:<14}{rows:>5}" + cells, flush=True)
    print("ratio: ours' time over theirs (below 1: ours is faster)")


if __name__ == "__main__":
    main()
