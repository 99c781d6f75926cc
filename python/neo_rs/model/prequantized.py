"""Decoder linears built from a checkpoint's tensors rather than loaded as floats: from its own
quantized weights (a GGUF's blocks, GPTQ or AWQ tensors), each read as ``Int4Blocks`` (or a GGUF's
other blocks as ``Int8Blocks``), or quantized
at load from its float weights one linear at a time (``quantize_at_load``). Every source is
placed as the loader places a float weight (the parts of a fused linear, a tensor-parallel rank's
rows or columns), so that no other placement logic exists."""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable, Hashable, Iterable
from pathlib import Path
from typing import Any, TypeVar

import torch
from safetensors import safe_open
from torch import nn

from neo_rs.config import ModelConfig
from neo_rs.errors import ModelLoadError
from neo_rs.model.loader import Placement, placements, quantizable
from neo_rs.model.quant import INT4_ROWS, Int4Blocks, common_form, decoder_linears, keeps, kept_linear
from neo_rs.parallel.shards import TpShard

Key = TypeVar("Key", bound=Hashable)
Parts = dict[str, list[tuple[Placement, Key]]]


class TensorIndex:
    """The tensors of a checkpoint's safetensors files, read one by one by name."""

    def __init__(self, files: list[Path]) -> None:
        self.files: dict[str, Path] = {}
        for path in files:
            with safe_open(str(path), framework="pt", device="cpu") as f:
                self.files.update(dict.fromkeys(f.keys(), path))  # noqa: SIM118 (not a mapping)

    def __contains__(self, name: str) -> bool:
        return name in self.files

    def with_suffix(self, suffix: str) -> list[str]:
        """The names ending in ``suffix``, without it."""
        return sorted(n.removesuffix(suffix) for n in self.files if n.endswith(suffix))

    def get(self, name: str) -> torch.Tensor:
        with safe_open(str(self.files[name]), framework="pt", device="cpu") as f:
            return f.get_tensor(name)


def check_covered(
    model: nn.Module, built: set[str], index: TensorIndex, cfg: ModelConfig, shard: TpShard
) -> None:
    """``ModelLoadError`` naming a decoder linear of ``model`` neither ``built`` from quantized
    tensors nor given float weights by the checkpoint."""
    floats = linear_parts(cfg, shard, ((n + ".weight", n) for n in index.with_suffix(".weight")))
    missing = [name for name, *_ in decoder_linears(model) if name not in built and name not in floats]
    if missing:
        raise ModelLoadError(f"the checkpoint lacks quantized or float weights for {', '.join(missing[:3])}")


def check_rows(qualified: str, found: list[tuple[Placement, Any]], out_features: int) -> None:
    """``ModelLoadError`` unless the parts ``found`` for linear ``qualified`` fill all its rows
    (a fused linear whose checkpoint has some of its parts and lacks the others)."""

    def height(place: Placement) -> int:
        if place.rows is None:
            return out_features
        span = place.rows[-1]
        assert isinstance(span, slice) and span.start is not None and span.stop is not None
        return span.stop - span.start

    rows = sum(height(place) for place, _ in found)
    if rows != out_features:
        raise ModelLoadError(
            f"{qualified}: the checkpoint's parts of it fill {rows} of its {out_features} rows"
        )


def linear_parts(cfg: ModelConfig, shard: TpShard, weights: Iterable[tuple[str, Key]]) -> Parts[Key]:
    """Our linear a quantization keeps (``layers.N.qkv_proj``...) -> where each source goes in it:
    ``weights`` gives (the HF name of the float weight a source stands for, a key to read it by)."""
    local = shard.local_config(cfg)
    parts: Parts[Key] = defaultdict(list)
    for name, key in weights:
        for place in placements(cfg, local, shard, name):
            if quantizable(place.ours):
                parts[place.ours.removesuffix(".weight")].append((place, key))
    return parts


def build_linears(
    model: nn.Module, parts: Parts[Key], read: Callable[[Key], Int4Blocks | None], keep: bool
) -> tuple[int, int, set[str]]:
    """Each decoder linear of ``model`` whose every part ``read`` gives blocks (of one column
    order, and groups that nest: ``quant.common_form``): a linear of them (``quant.kept_linear``)
    where ``keep`` and a kernel takes them (``quant.keeps``) and their shape (a rank's columns
    starting on a group and in order, rows in 16s), else their dequantized weight in its float
    weight (allocated here where the loader left it on meta). Returns (kept, dequantized, the
    names of the linears built)."""
    kept = dequantized = 0
    built: set[str] = set()
    home = model_home(model)
    for qualified, parent, attr, linear in decoder_linears(model):
        found = parts.get(qualified, [])
        read_once: dict[Any, Int4Blocks | None] = {}  # a fused source (Phi-3's) fills several parts
        for _, key in found:
            if key not in read_once:
                read_once[key] = read(key)
        blocks = [b for b in read_once.values() if b is not None]
        if not found or len(blocks) < len(read_once):
            continue
        check_rows(qualified, found, linear.out_features)
        common = common_form(blocks)
        if common is not None:  # each key's blocks in that form
            read_once.update(zip(list(read_once), common, strict=True))
        first = (common or blocks)[0]
        one_order = all(_same_order(b.order, first.order) for b in blocks)
        # A row-parallel rank's share of the input columns, where it is not all of them.
        split = [
            p.src[1]
            for p, key in found
            if p.src
            and len(p.src) > 1
            and (p.src[1].start, p.src[1].stop) != (0, _read(read_once, key).q.shape[1])
        ]
        fits = all(c.start % first.group == 0 for c in split) and not (split and first.order is not None)
        kernel = common is not None and keeps(first, home) and linear.out_features % INT4_ROWS == 0
        if keep and kernel and one_order and fits:
            q = torch.empty(linear.out_features, linear.in_features, dtype=first.q.dtype)
            scale = torch.empty(linear.out_features, linear.in_features // first.group)
            zero = torch.empty_like(scale)
            for place, key in found:
                part = _read(read_once, key)
                place_part(q, part.q, place, 1)
                place_part(scale, part.scale, place, first.group)
                place_part(zero, part.zero, place, first.group)
            setattr(parent, attr, kept_linear(linear, type(first)(q, scale, zero, first.order), home))
            kept += 1
        else:
            weight = float_weight(linear, home)
            for place, key in found:
                with torch.no_grad():
                    place_part(weight, _read(read_once, key).dequantized().to(home.dtype), place, 1)
            dequantized += 1
        built.add(qualified)
    return kept, dequantized, built


def quantize_at_load(
    model: nn.Module,
    files: list[Path],
    cfg: ModelConfig,
    shard: TpShard,
    make: Callable[[nn.Linear, torch.Tensor], nn.Module],
) -> int:
    """Each decoder linear of ``model`` (left on meta by the loader) as ``make(host, home)``
    makes it (``quant.quantizer``), from its float weight assembled on the host from the
    checkpoint's ``files``, one linear at a time: the device never holds a float copy. Returns
    how many."""
    index = TensorIndex(files)
    parts = linear_parts(cfg, shard, ((n + ".weight", n) for n in index.with_suffix(".weight")))
    home = model_home(model)
    count = 0
    for qualified, parent, attr, linear in decoder_linears(model):
        found = parts.get(qualified, [])
        check_rows(qualified, found, linear.out_features)
        host = nn.Linear(linear.in_features, linear.out_features, bias=False, device="meta")
        host.weight = nn.Parameter(
            torch.empty(linear.out_features, linear.in_features, dtype=home.dtype), False
        )
        sources = {
            key: index.get(key + ".weight").to(home.dtype) for key in dict.fromkeys(k for _, k in found)
        }
        with torch.no_grad():
            for place, key in found:  # a fused source (Phi-3's) fills several parts, read once
                place_part(host.weight, sources[key], place, 1)
        host.bias = linear.bias
        setattr(parent, attr, make(host, home))
        count += 1
    return count


def model_home(model: nn.Module) -> torch.Tensor:
    """A tensor of ``model``'s device and dtype: its embeddings."""
    weight = model.get_submodule("embed_tokens").weight
    assert isinstance(weight, torch.Tensor)
    return weight


def float_weight(linear: nn.Linear, home: torch.Tensor) -> torch.Tensor:
    """``linear``'s weight, allocated like ``home`` where the loader left it on the meta device
    (a quantized checkpoint's), to be dequantized into."""
    if linear.weight.is_meta:
        linear.weight = nn.Parameter(
            torch.empty_like(linear.weight, device=home.device, dtype=home.dtype), False
        )
    return linear.weight


def _same_order(a: torch.Tensor | None, b: torch.Tensor | None) -> bool:
    return (a is None and b is None) or (a is not None and b is not None and torch.equal(a, b))


def _read(read_once: dict[Any, Int4Blocks | None], key: Any) -> Int4Blocks:
    blocks = read_once[key]
    assert blocks is not None
    return blocks


def place_part(dst: torch.Tensor, src: torch.Tensor, place: Placement, per_col: int) -> None:
    """Copy the part of ``src`` that ``place`` reads into the part of ``dst`` it fills, column
    slices of the source in units of ``per_col`` columns (1 for values, the group for scales)."""
    index = place.src
    if index is not None and len(index) > 1:
        cols = index[1]
        # A short last group still has its scale: the stop rounds up.
        index = (index[0], slice(cols.start // per_col, -(-cols.stop // per_col)))
    part = src if index is None else src[index]
    (dst if place.rows is None else dst[place.rows]).copy_(part)
