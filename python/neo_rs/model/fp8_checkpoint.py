"""FP8 checkpoints (their ``quantization_config``: vLLM's and transformers' ``fp8`` without
blocks, ``fbgemm_fp8``, ``compressed-tensors``' float-quantized format): each decoder linear's e4m3
``weight`` and its ``weight_scale`` (one per output channel, ``[out, 1]``, or one per tensor)
become an ``Fp8Linear`` (``--quantization fp8``, inferred) or its dequantized weight (``none``),
placed as the loader places a float weight. A fused linear's parts keep their own scales: one per
tensor becomes one per each of its rows. A static ``input_scale`` is not used: the activations are
scaled per token at each call (``Fp8Linear``), which is said once in the log."""

from __future__ import annotations

import dataclasses
import logging
from pathlib import Path

import torch
from torch import nn

from neo_rs.config import ModelConfig
from neo_rs.errors import ModelLoadError
from neo_rs.model.fp8 import FP8, Fp8Linear
from neo_rs.model.prequantized import (
    TensorIndex,
    check_covered,
    check_rows,
    float_weight,
    linear_parts,
    model_home,
    place_part,
)
from neo_rs.model.quant import decoder_linears
from neo_rs.parallel.shards import TpShard

log = logging.getLogger(__name__)


def load_fp8_linears(
    model: nn.Module, files: list[Path], cfg: ModelConfig, shard: TpShard, keep: bool, scaled_mm: bool
) -> tuple[int, int]:
    """Fill each decoder linear of ``model`` (rank ``shard``'s) from the FP8 tensors in ``files``:
    an ``Fp8Linear`` where ``keep`` (``scaled_mm``: see ``fp8.scaled_mm_runs``), else dequantized.
    Returns (kept, dequantized); ``ModelLoadError`` names a linear with no weights at all."""
    index = TensorIndex(files)
    if index.with_suffix(".input_scale"):
        log.info("the checkpoint's static input scales are not used: activations are scaled per token")

    def read(module: str) -> tuple[torch.Tensor, torch.Tensor]:
        weight, scale = index.get(module + ".weight"), index.get(module + ".weight_scale").float().reshape(-1)
        if weight.dtype != FP8 or scale.numel() not in (1, weight.shape[0]):
            raise ModelLoadError(
                f"{module}: an e4m3 weight with one scale per row or per tensor expected, got "
                f"{weight.dtype} {tuple(weight.shape)} and {scale.numel()} scales"
            )
        return weight, scale.expand(weight.shape[0]).contiguous()

    parts = linear_parts(cfg, shard, ((m + ".weight", m) for m in index.with_suffix(".weight_scale")))
    kept = dequantized = 0
    built: set[str] = set()
    home = model_home(model)
    for qualified, parent, attr, linear in decoder_linears(model):
        found = parts.get(qualified)
        if not found:
            continue
        check_rows(qualified, found, linear.out_features)
        weight = torch.empty(linear.out_features, linear.in_features, dtype=FP8)
        scale = torch.empty(linear.out_features)
        read_once = {key: read(key) for key in dict.fromkeys(key for _, key in found)}
        for place, key in found:
            part, part_scale = read_once[key]
            place_part(weight, part, place, 1)
            # A scale per output row: the rows the weight takes, whatever its columns.
            place_part(scale, part_scale, dataclasses.replace(place, src=place.src and place.src[:1]), 1)
        if keep:
            setattr(parent, attr, Fp8Linear(linear, scaled_mm, weights=(weight, scale), home=home))
            kept += 1
        else:
            with torch.no_grad():
                float_weight(linear, home).copy_(weight.float() * scale[:, None])
            dequantized += 1
        built.add(qualified)
    check_covered(model, built, index, cfg, shard)
    return kept, dequantized
