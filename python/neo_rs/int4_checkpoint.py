"""What a GPTQ or AWQ checkpoint's ``quantization_config`` says, checked for what we load (the
packed tensors themselves are read by ``model/gptq_awq.py``)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from neo_rs.errors import ModelLoadError


@dataclass(frozen=True)
class Int4Checkpoint:
    """A checkpoint whose linears come as 4-bit GPTQ or AWQ tensors (``model/gptq_awq.py``):
    packed values, a scale and an integer zero per ``group_size`` input columns (-1: per row).
    ``zeros_minus_one``: GPTQ's original format, which stores each zero less one."""

    method: str  # "gptq" or "awq"
    group_size: int
    zeros_minus_one: bool = False

    @staticmethod
    def from_hf(quant: dict[str, Any], where: str) -> Int4Checkpoint:
        """Its ``quantization_config``; ``ModelLoadError`` naming a field we cannot load."""
        method = quant["quant_method"]

        def refuse(field: str, why: str) -> ModelLoadError:
            return ModelLoadError(f"{where}: quantization_config {field} {quant.get(field)!r}: {why}")

        if quant.get("bits") != 4:
            raise refuse("bits", "only 4-bit GPTQ and AWQ load")
        group = int(quant.get("group_size", 128))
        if group != -1 and (group <= 0 or group % 32):
            raise refuse("group_size", "takes multiples of 32 or -1")
        fmt = quant.get("checkpoint_format", "gptq")
        if method == "gptq" and fmt not in ("gptq", "gptq_v2"):
            raise refuse("checkpoint_format", "gptq or gptq_v2 only")
        if method == "awq" and str(quant.get("version", "gemm")).lower() != "gemm":
            raise refuse("version", "AWQ's GEMM layout only")
        if method == "awq" and not quant.get("zero_point", True):
            raise refuse("zero_point", "AWQ without zero points is not supported")
        return Int4Checkpoint(method, group, zeros_minus_one=method == "gptq" and fmt == "gptq")
