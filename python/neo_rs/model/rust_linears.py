"""Whether our Rust CPU linears run here: the bf16 one for a few rows (``packed.PackedLinear``) and
the int8 and int4 one for any rows (``quant``). Each has a scalar path, their reference and never
the engine's. The engine takes a SIMD path by default where it was timed against oneDNN's
(AVX512_BF16; AVX2 with oneDNN held to AVX2); the bf16 kernel's NEON paths (aarch64) are tested
against the scalar one under qemu-user but not yet timed on an Arm CPU, so there it runs only when
``NEO_RS_ROW_GEMV=1`` asks. The int8 and int4 kernel has AVX512_BF16's and AVX2's paths (no NEON
one); on AVX2 it runs int8 and int4 but not grouped int8 (``grouped_int8_kernel_applies``).
``NEO_RS_ROW_GEMV=0`` turns both off."""

from __future__ import annotations

import functools
import os

import torch

from neo_rs._core import Bf16Linear, QuantGemm

# The paths measured faster than oneDNN's GEMM on the CPUs that run them (``benches/gemv.py``,
# ``benches/quant_linear.py``).
_TIMED = frozenset({"avx512_bf16", "avx2"})


def gemv_path() -> str:
    """The bf16 kernel's path on this CPU: ``scalar``, ``avx2``, ``avx512_bf16``, ``neon`` or
    ``neon_bf16``."""
    return Bf16Linear(torch.zeros(1, 1, dtype=torch.bfloat16), num_threads=1).path


def gemv_applies() -> bool:
    """The bf16 kernel runs the engine's linears of a few rows on this CPU."""
    flag = os.environ.get("NEO_RS_ROW_GEMV")
    if flag == "0":
        return False
    path = gemv_path()
    return path in _TIMED or (path != "scalar" and flag == "1")


def quant_kernel_applies(device: torch.device, dtype: torch.dtype) -> bool:
    """Quantized linears of a ``dtype`` model on ``device`` run our kernel (``_core.QuantGemm``)."""
    if device.type != "cpu" or dtype != torch.bfloat16 or os.environ.get("NEO_RS_ROW_GEMV") == "0":
        return False
    return quant_path() in _TIMED


def grouped_int8_kernel_applies(device: torch.device, dtype: torch.dtype) -> bool:
    """Grouped int8 (a GGUF's Q8_0 or Q6_K, 8-bit GPTQ) runs our kernel: with AVX512_BF16, not AVX2
    alone, where oneDNN's f32 GEMM on the weight dequantized at load was 1.1-1.4x faster at 64
    rows and about level at one (SmolLM2's and Llama-3.2-1B's linears in groups of 32; int4 took
    0.52-0.90x the time of torch's kernel there, int8 0.58-1.01x but on the smallest at one row)."""
    return quant_kernel_applies(device, dtype) and quant_path() == "avx512_bf16"


@functools.cache
def quant_path() -> str:
    """The int8/int4 kernel's path on this CPU (``scalar``, ``avx2`` or ``avx512_bf16``), probed once:
    every quantized linear asks."""
    probe = QuantGemm.int8(torch.zeros(1, 1, 16, 2, dtype=torch.int8), torch.ones(1), n=1, k=1, num_threads=1)
    return str(probe.path)
