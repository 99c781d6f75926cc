"""Whether our Rust CPU linears run natively here: the bf16 one for a few rows
(``packed.PackedLinear``) and the int8 and int4 one for any rows (``quant``), both AVX512_BF16 (a
scalar path is their reference, never the engine's). ``NEO_RS_ROW_GEMV=0`` turns them off."""

from __future__ import annotations

import os

import torch

from neo_rs._core import Bf16Linear


def gemv_applies() -> bool:
    """The Rust linears run natively on this CPU, unless turned off."""
    if os.environ.get("NEO_RS_ROW_GEMV", "1") == "0":
        return False
    probe = torch.zeros(1, 1, dtype=torch.bfloat16)
    return Bf16Linear(probe, num_threads=1).path != "scalar"


def quant_kernel_applies(device: torch.device, dtype: torch.dtype) -> bool:
    """Quantized linears of a ``dtype`` model on ``device`` run our kernel (``_core.QuantGemm``)."""
    return device.type == "cpu" and dtype == torch.bfloat16 and gemv_applies()
