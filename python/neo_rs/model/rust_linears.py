"""Whether our Rust CPU linears run here: the bf16 one for a few rows (``packed.PackedLinear``) and
the int8 and int4 one for any rows (``quant``). Each has a scalar path, their reference and never
the engine's. The engine takes a SIMD path by default where it was timed against oneDNN's
(AVX512_BF16; AVX2 with oneDNN held to AVX2); the bf16 kernel's NEON paths (aarch64) are tested
against the scalar one under qemu-user but not yet timed on an Arm CPU, so there it runs only when
``NEO_RS_ROW_GEMV=1`` asks. The int8 and int4 kernel has the same paths (NEON's likewise tested,
untimed, and run only when asked), each for bf16, float16 and float32 models (AVX512_BF16's multiplies
bf16 by ``vdpbf16ps`` and float16 and float32 in f32 lanes); on AVX2 it runs int8 and int4 but not
grouped int8 (``grouped_int8_kernel_applies``). ``NEO_RS_ROW_GEMV=0`` turns both off."""

from __future__ import annotations

import functools
import os

import torch

from neo_rs._core import Bf16Linear

# The paths measured faster than oneDNN's GEMM on the CPUs that run them (``benches/gemv.py``,
# ``benches/quant_linear.py``).
_TIMED = frozenset({"avx512_bf16", "avx2"})


@functools.cache
def gemv_path() -> str:
    """The Rust linears' path on this CPU, the bf16 kernel's and the int8/int4 one's alike:
    ``scalar``, ``avx2``, ``avx512_bf16``, ``neon`` or ``neon_bf16`` (probed once: every linear
    asks)."""
    return Bf16Linear(torch.zeros(1, 1, dtype=torch.bfloat16), num_threads=1).path


def _runs(path: str) -> bool:
    """A kernel's ``path`` runs the engine's linears: a timed one unless ``NEO_RS_ROW_GEMV=0``, an
    untimed SIMD one (NEON's) when ``NEO_RS_ROW_GEMV=1`` asks, the scalar reference never."""
    flag = os.environ.get("NEO_RS_ROW_GEMV")
    return flag != "0" and (path in _TIMED or (path != "scalar" and flag == "1"))


def gemv_applies() -> bool:
    """The bf16 kernel runs the engine's linears of a few rows on this CPU."""
    return _runs(gemv_path())


# The dtypes the int8/int4 kernel takes: its ``x``, its output, its groups' scales and zeros.
_QUANT_DTYPES = frozenset({torch.bfloat16, torch.float16, torch.float32})


def quant_kernel_applies(device: torch.device, dtype: torch.dtype) -> bool:
    """Quantized linears of a ``dtype`` model on ``device`` run our kernel (``_core.QuantGemm``).
    In float32 and float16 torch's int8 and int4 kernels took 8-130x the time of a dense GEMM of
    the same weight, and our AVX2 path 0.01-0.15x theirs (``benches/quant_kernels.py --dtype
    float32``)."""
    return device.type == "cpu" and dtype in _QUANT_DTYPES and _runs(gemv_path())


def grouped_int8_kernel_applies(device: torch.device, dtype: torch.dtype) -> bool:
    """Grouped int8 (a GGUF's Q8_0 or Q6_K, 8-bit GPTQ) runs our kernel: with AVX512_BF16, not AVX2
    alone, where oneDNN's f32 GEMM on the weight dequantized at load was 1.1-1.4x faster at 64
    rows and about level at one (SmolLM2's and Llama-3.2-1B's linears in groups of 32; int4 took
    0.52-0.90x the time of torch's kernel there, int8 0.58-1.01x but on the smallest at one row).
    A float32 model's on AVX-512 took 0.36-0.89x the time of ``F.linear`` on the weight
    dequantized up to 4 rows and 1.1-1.75x at 64, with a quarter of its memory."""
    return quant_kernel_applies(device, dtype) and gemv_path() == "avx512_bf16"
