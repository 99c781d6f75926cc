"""GPTQ and AWQ checkpoints (4 bits; GPTQ's also 8, their ``quantization_config``): each linear's
packed tensors read as ``Int4Blocks`` (8 bits: ``Int8Blocks``) and kept as an ``Int4Linear``
(a ``GroupedInt8Linear``) (``--quantization gptq|awq``, inferred from the checkpoint), or
dequantized into the model dtype (``--quantization none``, or where no kernel runs them: 8
bits has only our Rust and Triton kernels, ``quant.grouped_int8_runs``). The loader skips these
tensors (``load_model``); this fills the linears after it.

- GPTQ: ``qweight`` int32 ``[in / p, out]`` (``p = 32 / bits`` values a word), input row ``p i
  + k`` in bits ``bits k ..`` of word row ``i``; ``qzeros`` int32 ``[groups, out / p]``, output
  column ``p j + k`` in value ``k`` (the original format stores each zero less one, ``gptq_v2``
  as it is); ``scales`` ``[groups, out]``; ``g_idx`` ``[in]``, each input column's group
  (act-order scatters them: the columns are then sorted by group and the input gathered into
  that order, as vLLM does).
- AWQ (GEMM): ``qweight`` int32 ``[in, out / 8]`` and ``qzeros`` ``[groups, out / 8]``, output
  columns 0, 2, 4, 6, 1, 3, 5, 7 of a word in its nibbles 0..7; ``scales`` ``[groups, out]``.

Both mean ``w = (q - zero) * scale``, which is ``Int4Linear``'s ``(q - 8) * scale + zero'``
with ``zero' = (8 - zero) * scale`` (8 bits: ``GroupedInt8Linear``'s ``(q - 128) * scale +
zero'``, ``zero' = (128 - zero) * scale``). Larger groups (-1: a whole row) become the kernel's
largest that divides them (128, 64 or 32 columns), their scale and zero repeated."""

from __future__ import annotations

from pathlib import Path

import torch
from torch import nn

from neo_rs.config import ModelConfig
from neo_rs.errors import ModelLoadError
from neo_rs.model.loader import PACKED_TENSORS
from neo_rs.model.prequantized import TensorIndex, build_linears, check_covered, linear_parts
from neo_rs.model.quant import Int4Blocks, Int8Blocks, int4_group_size
from neo_rs.parallel.shards import TpShard
from neo_rs.quantized_checkpoint import QuantizedCheckpoint

# AWQ: output column k of a word sits in its nibble [0, 4, 1, 5, 2, 6, 3, 7][k].
_AWQ_SLOTS = torch.tensor([0, 4, 1, 5, 2, 6, 3, 7], dtype=torch.int32)


def unpack(words: torch.Tensor, bits: int, slots: torch.Tensor | None = None) -> torch.Tensor:
    """int32 ``[..., n]`` -> uint8 ``[..., p n]`` (``p = 32 / bits``): value ``k`` of word ``j``
    (in slot ``slots[k]``, bits ``bits * slots[k]`` up; in order by default) at ``p j + k``."""
    slots = torch.arange(32 // bits, dtype=torch.int32) if slots is None else slots
    values = (words[..., None] >> (slots * bits)) & ((1 << bits) - 1)
    return values.reshape(*words.shape[:-1], -1).to(torch.uint8)


def blocks_of(tensors: dict[str, torch.Tensor], spec: QuantizedCheckpoint, where: str) -> Int4Blocks:
    """One linear's packed tensors (by suffix: qweight, qzeros, scales, g_idx) as ``Int4Blocks``
    (8 bits: ``Int8Blocks``) in the largest groups of the kernel that divide the checkpoint's
    (``int4_group_size``)."""
    qweight, qzeros, scales = tensors["qweight"], tensors["qzeros"], tensors["scales"].float()
    if spec.method == "gptq":
        q = unpack(qweight.t(), spec.bits)  # [out, in]
        zeros = unpack(qzeros, spec.bits).float() + float(spec.zeros_minus_one)
    else:
        q = unpack(qweight, 4, _AWQ_SLOTS).t()
        zeros = unpack(qzeros, 4, _AWQ_SLOTS).float()
    out, cols = q.shape
    group = cols if spec.group_size == -1 else spec.group_size
    if scales.shape != (cols // group, out) or zeros.shape != scales.shape:
        raise ModelLoadError(
            f"{where}: scales {tuple(scales.shape)} and zeros {tuple(zeros.shape)} do not fit a "
            f"[{out}, {cols}] weight in groups of {group}"
        )
    order = _act_order(tensors.get("g_idx"), cols, group, where)
    if order is not None:
        q = q[:, order]  # each group's columns together, as the kernel reads them
    kernel_group = int4_group_size(group)
    if kernel_group is None:
        raise ModelLoadError(f"{where}: groups of {group} columns split into none our kernels take")
    repeat = group // kernel_group
    middle = 1 << (spec.bits - 1)  # the kernels' values are q less this
    scale = scales.t().repeat_interleave(repeat, dim=1).contiguous()
    zero = ((middle - zeros) * scales).t().repeat_interleave(repeat, dim=1).contiguous()
    if spec.bits == 8:
        return Int8Blocks((q.to(torch.int16) - middle).to(torch.int8).contiguous(), scale, zero, order)
    return Int4Blocks(q.contiguous(), scale, zero, order)


def _act_order(g_idx: torch.Tensor | None, cols: int, group: int, where: str) -> torch.Tensor | None:
    """The input columns group by group where ``g_idx`` scatters them (act-order GPTQ), or None
    where each group's columns are consecutive already."""
    if g_idx is None or torch.equal(g_idx.long(), torch.arange(cols) // group):
        return None
    counts = torch.bincount(g_idx.long(), minlength=cols // group)
    if g_idx.shape != (cols,) or len(counts) != cols // group or not bool((counts == group).all()):
        raise ModelLoadError(f"{where}: g_idx does not give each of {cols // group} groups {group} columns")
    return torch.argsort(g_idx.long(), stable=True)


def load_packed_linears(
    model: nn.Module, files: list[Path], cfg: ModelConfig, shard: TpShard, keep: bool
) -> tuple[int, int]:
    """Fill each decoder linear of ``model`` (rank ``shard``'s) from the packed tensors in
    ``files``: kept as int4 where ``keep``, else dequantized. Returns (kept, dequantized);
    ``ModelLoadError`` names a linear the checkpoint has neither packed nor float."""
    spec = cfg.quantized_checkpoint
    assert spec is not None
    index = TensorIndex(files)

    def read(module: str) -> Int4Blocks:
        tensors = {s[1:]: index.get(module + s) for s in PACKED_TENSORS if module + s in index}
        return blocks_of(tensors, spec, module)

    modules = index.with_suffix(".qweight")
    parts = linear_parts(cfg, shard, ((module + ".weight", module) for module in modules))
    kept, dequantized, built = build_linears(model, parts, read, keep)
    check_covered(model, built, index, cfg, shard)
    return kept, dequantized
