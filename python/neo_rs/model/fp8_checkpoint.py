"""FP8 checkpoints (their ``quantization_config``: vLLM's and transformers' ``fp8``,
``fbgemm_fp8``, ``compressed-tensors``' float-quantized format): each decoder linear's e4m3
``weight`` and its scales become an ``Fp8Linear`` (``--quantization fp8``, inferred) or its
dequantized weight (``none``), placed as the loader places a float weight. The scales are one per
output channel (``[out, 1]``), one per tensor, or one per block of rows and input columns
(``weight_block_size``'s ``weight_scale_inv``, compressed-tensors' ``block`` strategy, ``[ceil(out /
rows), ceil(in / columns)]``). Each is kept as a scale per row (of each group of input columns,
for blocks), so a fused linear's parts keep their own scales and a tensor-parallel rank takes its
rows' scales with them; a rank whose share of a row-parallel linear's input columns does not start
on a block is dequantized (the load's log line counts it). A static ``input_scale`` is not used:
the activations are scaled per token at each call (``Fp8Linear``), which is said once in the
log."""

from __future__ import annotations

import dataclasses
import logging
from pathlib import Path

import torch
from torch import nn

from neo_rs.config import ModelConfig
from neo_rs.errors import ModelLoadError
from neo_rs.model.fp8 import FP8, Fp8Linear, Fp8Weights
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

# A checkpoint's scales: compressed-tensors' and per-channel ``fp8``'s, then block-wise ``fp8``'s.
_SCALE_SUFFIXES = (".weight_scale", ".weight_scale_inv")


def read_fp8(index: TensorIndex, module: str, block: tuple[int, int] | None) -> Fp8Weights:
    """``module``'s e4m3 weight and its scales, one per row (``group``: the whole row) or, with a
    ``block`` of (rows, input columns), one per row and group of that many input columns;
    ``ModelLoadError`` names a weight or scales of another shape or type."""
    weight = index.get(module + ".weight")
    suffix = next(s for s in _SCALE_SUFFIXES if module + s in index)
    scale = index.get(module + suffix).float()
    out, cols = weight.shape
    if block is not None:
        rows, group = block
        blocks = (-(-out // rows), -(-cols // group))
        if weight.dtype != FP8 or tuple(scale.shape) != blocks:
            raise ModelLoadError(
                f"{module}: an e4m3 weight with {blocks} scales (blocks of {rows} x {group}) expected, "
                f"got {weight.dtype} {tuple(weight.shape)} and {suffix[1:]} {tuple(scale.shape)}"
            )
        return Fp8Weights(weight, scale.repeat_interleave(rows, dim=0)[:out].contiguous(), group)
    scale = scale.reshape(-1)
    if weight.dtype != FP8 or scale.numel() not in (1, out):
        raise ModelLoadError(
            f"{module}: an e4m3 weight with one scale per row or per tensor expected, got "
            f"{weight.dtype} {tuple(weight.shape)} and {scale.numel()} scales"
        )
    return Fp8Weights(weight, scale.expand(out).contiguous()[:, None], cols)


def load_fp8_linears(
    model: nn.Module,
    files: list[Path],
    cfg: ModelConfig,
    shard: TpShard,
    keep: bool,
    scaled_mm: bool,
    block: tuple[int, int] | None = None,
) -> tuple[int, int]:
    """Fill each decoder linear of ``model`` (rank ``shard``'s) from the FP8 tensors in ``files``
    (``block``: their scales' block shape, None per row or tensor): an ``Fp8Linear`` where
    ``keep`` (``scaled_mm``: see ``fp8.scaled_mm_runs``) and this rank's columns start on a group,
    else dequantized. Returns (kept, dequantized); ``ModelLoadError`` names a linear with no
    weights at all."""
    index = TensorIndex(files)
    if index.with_suffix(".input_scale"):
        log.info("the checkpoint's static input scales are not used: activations are scaled per token")
    modules = sorted({m for s in _SCALE_SUFFIXES for m in index.with_suffix(s)})
    parts = linear_parts(cfg, shard, ((m + ".weight", m) for m in modules))
    kept = dequantized = 0
    built: set[str] = set()
    home = model_home(model)
    for qualified, parent, attr, linear in decoder_linears(model):
        found = parts.get(qualified)
        if not found:
            continue
        check_rows(qualified, found, linear.out_features)
        read_once = {key: read_fp8(index, key, block) for key in dict.fromkeys(key for _, key in found)}
        group = block[1] if block else linear.in_features
        # A row-parallel rank's columns: kept if they start on a group (per row: one group).
        fits = all(p.src is None or len(p.src) < 2 or p.src[1].start % group == 0 for p, _ in found)
        if keep and (block is None or fits):
            weight = torch.empty(linear.out_features, linear.in_features, dtype=FP8)
            scale = torch.empty(linear.out_features, -(-linear.in_features // group))
            for place, key in found:
                part = read_once[key]
                place_part(weight, part.q, place, 1)
                if block is None:  # the rows the weight takes, whatever its columns
                    rows_only = dataclasses.replace(place, src=place.src and place.src[:1])
                    place_part(scale, part.scale, rows_only, 1)
                else:
                    place_part(scale, part.scale, place, group)
            made = Fp8Linear(linear, scaled_mm, weights=Fp8Weights(weight, scale, group), home=home)
            setattr(parent, attr, made)
            kept += 1
        else:
            target = float_weight(linear, home)
            with torch.no_grad():
                for place, key in found:
                    place_part(target, read_once[key].dequantized().to(target.dtype), place, 1)
            dequantized += 1
        built.add(qualified)
    check_covered(model, built, index, cfg, shard)
    return kept, dequantized
