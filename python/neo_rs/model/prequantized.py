"""Decoder linears built from a checkpoint's own 4-bit weights (a GGUF's blocks, GPTQ or AWQ
tensors): each source tensor read as ``Blocks`` (``Int4Linear``'s form, ``w = (q - 8) * scale +
zero`` per group of input columns) and placed as the loader places a float weight: the parts of
a fused linear, a tensor-parallel rank's rows or columns, so no other placement logic exists."""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable, Hashable, Iterable
from typing import Any, TypeVar

import torch
from torch import nn

from neo_rs.config import ModelConfig
from neo_rs.model.loader import Placement, placements
from neo_rs.model.quant import INT4_ROWS, Int4Linear, decoder_linears
from neo_rs.parallel.shards import TpShard

# q (uint8 [out, in], 0..15), scale and zero (float32 [out, in / group]).
Blocks = tuple[torch.Tensor, torch.Tensor, torch.Tensor]
Key = TypeVar("Key", bound=Hashable)
Parts = dict[str, list[tuple[Placement, Key]]]


def linear_parts(cfg: ModelConfig, shard: TpShard, weights: Iterable[tuple[str, Key]]) -> Parts[Key]:
    """Our linear (``layers.N.qkv_proj``...) -> where each source goes in it: ``weights`` gives
    (the HF name of the float weight a source stands for, a key to read it by)."""
    local = shard.local_config(cfg)
    parts: Parts[Key] = defaultdict(list)
    for name, key in weights:
        for place in placements(cfg, local, shard, name):
            parts[place.ours.removesuffix(".weight")].append((place, key))
    return parts


def dequantize(blocks: Blocks) -> torch.Tensor:
    """The float32 weight ``blocks`` stand for."""
    q, scale, zero = blocks
    group = q.shape[1] // scale.shape[1]
    w = (q.float() - 8).reshape(*scale.shape, group) * scale[..., None] + zero[..., None]
    return w.reshape(q.shape)


def build_linears(
    model: nn.Module, parts: Parts[Key], read: Callable[[Key], Blocks | None], keep: bool
) -> tuple[int, int, set[str]]:
    """Each decoder linear of ``model`` whose every part ``read`` gives blocks (of one group
    size): an ``Int4Linear`` of them where ``keep`` and the kernel takes its shape (a rank's
    columns starting on a group, rows in 16s), else their dequantized weight in its float
    weight. Returns (kept, dequantized, the names of the linears built)."""
    kept = dequantized = 0
    built: set[str] = set()
    for qualified, parent, attr, linear in decoder_linears(model):
        found = parts.get(qualified, [])
        read_once: dict[Any, Blocks | None] = {}  # a fused source (Phi-3's) fills several parts
        for _, key in found:
            if key not in read_once:
                read_once[key] = read(key)
        if not found or any(b is None for b in read_once.values()):
            continue
        first = _read(read_once, found[0][1])
        group = first[0].shape[1] // first[1].shape[1]
        columns_split = any(p.src and len(p.src) > 1 and p.src[1].start % group for p, _ in found)
        if keep and not columns_split and linear.out_features % INT4_ROWS == 0:
            q = torch.empty(linear.out_features, linear.in_features, dtype=torch.uint8)
            scale = torch.empty(linear.out_features, linear.in_features // group)
            zero = torch.empty_like(scale)
            for place, key in found:
                for dst, src, per_col in zip(
                    (q, scale, zero), _read(read_once, key), (1, group, group), strict=True
                ):
                    _place(dst, src, place, per_col)
            setattr(parent, attr, Int4Linear(linear, blocks=(q, scale, zero, group)))
            kept += 1
        else:
            for place, key in found:
                w = dequantize(_read(read_once, key)).to(linear.weight.dtype)
                with torch.no_grad():
                    _place(linear.weight, w, place, 1)
            dequantized += 1
        built.add(qualified)
    return kept, dequantized, built


def _read(read_once: dict[Any, Blocks | None], key: Any) -> Blocks:
    blocks = read_once[key]
    assert blocks is not None
    return blocks


def _place(dst: torch.Tensor, src: torch.Tensor, place: Placement, per_col: int) -> None:
    """Copy the part of ``src`` that ``place`` reads into the part of ``dst`` it fills, column
    slices of the source in units of ``per_col`` columns (1 for values, the group for scales)."""
    index = place.src
    if index is not None and len(index) > 1:
        cols = index[1]
        index = (index[0], slice(cols.start // per_col, cols.stop // per_col))
    part = src if index is None else src[index]
    (dst if place.rows is None else dst[place.rows]).copy_(part)
