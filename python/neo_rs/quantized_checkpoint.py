"""What a quantized checkpoint's ``quantization_config`` says, checked for what we load: 4-bit
GPTQ and AWQ, 8-bit GPTQ (``model/gptq_awq.py``), and FP8 weights with a scale per channel, per
tensor or per block (``model/fp8_checkpoint.py``): vLLM's and transformers' ``fp8`` (blocks:
``weight_block_size``, as DeepSeek's and Qwen3's FP8 checkpoints), ``fbgemm_fp8``, and
``compressed-tensors``' float-quantized format (blocks: its ``block`` strategy)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from neo_rs.errors import ModelLoadError

# quantization_config's quant_method -> the method the weights are kept in (--quantization).
QUANT_METHODS = {"gptq": "gptq", "awq": "awq", "fp8": "fp8", "fbgemm_fp8": "fp8", "compressed-tensors": "fp8"}


@dataclass(frozen=True)
class QuantizedCheckpoint:
    """A checkpoint whose linears come quantized. ``gptq``, ``awq``: packed values of ``bits``
    (4; GPTQ's also 8), a scale and an integer zero per ``group_size`` input columns (-1: per
    row); ``zeros_minus_one``: GPTQ's original format, which stores each zero less one. ``fp8``:
    e4m3 weights and their ``weight_scale`` (``block``: a scale per block of (rows, input
    columns), ``weight_scale_inv`` in ``fp8``'s format)."""

    method: str
    group_size: int = -1
    zeros_minus_one: bool = False
    bits: int = 4
    block: tuple[int, int] | None = None

    @staticmethod
    def from_hf(quant: dict[str, Any], where: str) -> QuantizedCheckpoint:
        """Its ``quantization_config``; ``ModelLoadError`` naming a field we cannot load."""
        kind = quant["quant_method"]

        def refuse(field: str, why: str, value: Any = None) -> ModelLoadError:
            shown = quant.get(field) if value is None else value
            return ModelLoadError(f"{where}: quantization_config {field} {shown!r}: {why}")

        def block_of(field: str, value: Any) -> tuple[int, int]:
            ok = isinstance(value, list | tuple) and len(value) == 2
            if not ok or not all(isinstance(v, int) and v > 0 for v in value):
                raise refuse(field, "a block of [rows, input columns], both positive", value)
            return value[0], value[1]

        block = None
        if kind == "fp8" and quant.get("weight_block_size") is not None:
            block = block_of("weight_block_size", quant["weight_block_size"])
        if kind == "compressed-tensors":
            if quant.get("format") not in ("float-quantized", "naive-quantized"):
                raise refuse("format", "only its FP8 (float-quantized) format loads")
            for name, group in (quant.get("config_groups") or {}).items():
                weights = group.get("weights") or {}
                fp8 = weights.get("num_bits") == 8 and weights.get("type") == "float"
                if not fp8 or weights.get("strategy") not in ("channel", "tensor", "block"):
                    raise refuse(
                        f"config_groups.{name}.weights", "FP8 per channel, tensor or block only", weights
                    )
                if weights["strategy"] == "block":
                    field = f"config_groups.{name}.weights.block_structure"
                    shape = block_of(field, weights.get("block_structure"))
                    if block not in (None, shape):
                        raise refuse(field, f"one block shape for every group, not also {block}", shape)
                    block = shape
        if QUANT_METHODS[kind] == "fp8":
            return QuantizedCheckpoint("fp8", block=block)
        bits = quant.get("bits")
        if kind == "awq" and bits != 4:
            raise refuse("bits", "AWQ loads 4 bits only")
        if bits not in (4, 8):
            raise refuse("bits", "GPTQ loads 4 or 8 bits")
        group = int(quant.get("group_size", 128))
        if group != -1 and (group <= 0 or group % 32):
            raise refuse("group_size", "takes multiples of 32 or -1")
        fmt = quant.get("checkpoint_format", "gptq")
        if kind == "gptq" and fmt not in ("gptq", "gptq_v2"):
            raise refuse("checkpoint_format", "gptq or gptq_v2 only")
        if kind == "awq" and str(quant.get("version", "gemm")).lower() != "gemm":
            raise refuse("version", "AWQ's GEMM layout only")
        if kind == "awq" and not quant.get("zero_point", True):
            raise refuse("zero_point", "AWQ without zero points is not supported")
        return QuantizedCheckpoint(kind, group, zeros_minus_one=kind == "gptq" and fmt == "gptq", bits=bits)
