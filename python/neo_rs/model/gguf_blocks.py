"""GGUF's block types kept quantized (``--quantization gguf``, inferred for a ``.gguf`` model):
- Q4_0, Q4_1 and Q4_K store each block of 32 weights of a row as 4-bit values ``q`` with one
  scale and one offset (Q4_K's come from its super-block's 6-bit sub-scales), which is exactly
  ``Int4Linear``'s form in groups of 32, ``w = (q - 8) * scale + zero``;
- Q8_0, Q5_0, Q5_1, Q5_K (groups of 32) and Q6_K (of 16) store values of 5 to 8 bits with a
  scale (and Q5_1's and Q5_K's offset) per group: ``GroupedInt8Linear``'s ``w = q * scale +
  zero`` with ``q`` an int8. Only our CPU kernel runs that form (``quant_kernel_applies``);
  elsewhere these types are dequantized at load, and the log says so.

So the decoder linears whose every part the file stores in a kept type are rebuilt from the
file's blocks, with no requantization (the scales in the model dtype; a linear with 4- and 6-bit
parts, as Q4_K_M files fuse, as grouped int8 in groups of 16); the others keep the weights the
conversion dequantized.

The loader reads the converted checkpoint (``gguf.py``) but for the linears kept here
(``GgufBlocks.weights``), which it leaves unallocated; ``GgufBlocks.keep`` then builds them from
the file's blocks, placed as the loader places a float weight (fused parts, tensor-parallel shards), so
they never exist as floats."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn

from neo_rs.config import ModelConfig
from neo_rs.model.gguf import (
    GGUF_MODEL_TYPES,
    PERMUTED_QK,
    architecture,
    open_gguf,
    unpermute_qk,
    weight_tensors,
)
from neo_rs.model.prequantized import build_linears, linear_parts
from neo_rs.model.quant import Int4Blocks, Int8Blocks, decoder_linears
from neo_rs.parallel.shards import TpShard

GROUP = 32
INT4_TYPES = ("Q4_0", "Q4_1", "Q4_K")
INT8_TYPES = ("Q8_0", "Q5_0", "Q5_1", "Q5_K", "Q6_K")
KEPT_TYPES = INT4_TYPES + INT8_TYPES


def _f16(blocks: np.ndarray, at: int) -> np.ndarray:
    """The fp16 field at byte ``at`` of each block, as float32 ``[n, 1]``."""
    return blocks[:, at : at + 2].copy().view(np.float16).astype(np.float32)


def int4_blocks(tensor: Any) -> Int4Blocks:
    """A Q4_0, Q4_1 or Q4_K tensor of ``[rows, cols]`` as ``(q, scale, zero)``: ``q`` the 4-bit
    values (uint8 ``[rows, cols]``), ``scale`` and ``zero`` float32 ``[rows, cols / 32]``, such
    that ``(q - 8) * scale + zero`` is what ``gguf`` dequantizes (exactly, in float32)."""
    from gguf.quants import Q4_K

    kind = tensor.tensor_type.name
    rows = int(tensor.shape[-1])  # gguf lists the shape innermost first
    raw = np.asarray(tensor.data, dtype=np.uint8).reshape(rows, -1)
    if kind == "Q4_K":
        # Super-blocks of 256: d, dmin, 12 bytes of 6-bit sub-scales and mins, then 128 bytes in
        # which each 32 bytes hold two sub-blocks (low nibbles first).
        blocks = raw.reshape(-1, 144)
        sc, mn = Q4_K.get_scale_min(blocks[:, 4:16])
        scale = _f16(blocks, 0) * sc.astype(np.float32)
        low = _f16(blocks, 2) * mn.astype(np.float32)  # w = q * scale - low
        qs = blocks[:, 16:].reshape(-1, 4, 1, 32) >> np.array([0, 4], dtype=np.uint8).reshape(1, 1, 2, 1)
        zero = 8 * scale - low
    else:
        # Blocks of 32: d (and Q4_1's m), then 16 bytes, element j in the low nibble of byte j and
        # element j + 16 in its high nibble.
        size = 18 if kind == "Q4_0" else 20
        blocks = raw.reshape(-1, size)
        scale = _f16(blocks, 0)
        zero = np.zeros_like(scale) if kind == "Q4_0" else _f16(blocks, 2) + 8 * scale
        qs = blocks[:, size - 16 :].reshape(-1, 1, 16) >> np.array([0, 4], dtype=np.uint8).reshape(1, 2, 1)
    q = torch.from_numpy((qs & 0x0F).reshape(rows, -1))
    groups = q.shape[1] // GROUP
    return Int4Blocks(
        q, torch.from_numpy(scale.reshape(rows, groups)), torch.from_numpy(zero.reshape(rows, groups))
    )


def _five_bits(low: np.ndarray, high: np.ndarray, count: int) -> np.ndarray:
    """Q5_0/Q5_1's 32 values a block (uint8 ``[n, 32]``): element ``j``'s low 4 bits in byte
    ``j % 16`` of ``low`` (its high nibble from 16 on), its fifth in bit ``j`` of ``high``'s
    little-endian 32 bits."""
    nibbles = (low.reshape(-1, 1, 16) >> np.array([0, 4], dtype=np.uint8).reshape(1, 2, 1)) & 0x0F
    bits = (high.copy().view("<u4") >> np.arange(count, dtype=np.uint32)) & 1
    return nibbles.reshape(-1, count) | (bits.astype(np.uint8) << 4)


def int8_blocks(tensor: Any) -> Int8Blocks:
    """A Q8_0, Q5_0, Q5_1, Q5_K or Q6_K tensor of ``[rows, cols]`` as ``(q, scale, zero)``: ``q``
    int8 ``[rows, cols]``, ``scale`` and ``zero`` float32 ``[rows, cols / group]`` (groups of
    32, Q6_K's of 16), such that ``q * scale + zero`` is what ``gguf`` dequantizes (exactly, in
    float32: the same products, and Q5_K's offset subtracted as it subtracts it)."""
    kind = tensor.tensor_type.name
    rows = int(tensor.shape[-1])
    raw = np.asarray(tensor.data, dtype=np.uint8).reshape(rows, -1)
    if kind == "Q8_0":  # d, then 32 int8
        blocks = raw.reshape(-1, 34)
        q = blocks[:, 2:].view(np.int8)
        scale, zero = _f16(blocks, 0), np.zeros((len(blocks), 1), np.float32)
    elif kind in ("Q5_0", "Q5_1"):  # d (and Q5_1's m), 4 bytes of fifth bits, 16 of nibbles
        at = 2 if kind == "Q5_0" else 4
        blocks = raw.reshape(-1, at + 20)
        q = _five_bits(blocks[:, at + 4 :], blocks[:, at : at + 4], 32).astype(np.int8)
        scale = _f16(blocks, 0)
        if kind == "Q5_0":
            q, zero = q - 16, np.zeros_like(scale)
        else:
            zero = _f16(blocks, 2)
    elif kind == "Q5_K":
        # Super-blocks of 256: d, dmin, 12 bytes of 6-bit sub-scales and mins, 32 bytes of fifth
        # bits (bit s of byte j: sub-block s's element j), 128 of nibbles as Q4_K's.
        from gguf.quants import Q4_K

        blocks = raw.reshape(-1, 176)
        sc, mn = Q4_K.get_scale_min(blocks[:, 4:16])
        scale = _f16(blocks, 0) * sc.astype(np.float32)
        zero = -(_f16(blocks, 2) * mn.astype(np.float32))
        low = (
            blocks[:, 48:].reshape(-1, 4, 1, 32) >> np.array([0, 4], dtype=np.uint8).reshape(1, 1, 2, 1)
        ) & 0x0F
        high = (blocks[:, 16:48].reshape(-1, 1, 32) >> np.arange(8, dtype=np.uint8).reshape(1, 8, 1)) & 1
        q = (low.reshape(-1, 8, 32) | high << 4).astype(np.int8)
    else:  # Q6_K: 128 bytes of low nibbles, 64 of high 2-bit pairs, 16 int8 sub-scales, d
        blocks = raw.reshape(-1, 210)
        low = (
            blocks[:, :128].reshape(-1, 2, 1, 64) >> np.array([0, 4], dtype=np.uint8).reshape(1, 1, 2, 1)
        ) & 0x0F
        high = (
            blocks[:, 128:192].reshape(-1, 2, 1, 32)
            >> np.array([0, 2, 4, 6], dtype=np.uint8).reshape(1, 1, 4, 1)
        ) & 3
        q = (low.reshape(-1, 8, 32) | high.reshape(-1, 8, 32) << 4).astype(np.int8) - 32
        scale = _f16(blocks, 208) * blocks[:, 192:208].view(np.int8).astype(np.float32)
        zero = np.zeros_like(scale)
    q_t, scale_t, zero_t = (
        torch.from_numpy(np.ascontiguousarray(a).reshape(rows, -1)) for a in (q, scale, zero)
    )
    return Int8Blocks(q_t, scale_t, zero_t)


class GgufBlocks:
    """GGUF ``path``'s blocks for rank ``shard``: ``weights``, our weights
    (``layers.N.qkv_proj.weight``...) whose every part the file stores in a kept type (the 5- to
    8-bit ones only where ``grouped_int8``: our kernel runs), for the loader to leave
    unallocated; then ``keep`` builds those linears. ``dequantized_types``: the file's 5- to 8-bit
    types of decoder linears left to the loader for want of the kernel. The file is opened once
    (its metadata takes seconds to parse)."""

    def __init__(self, path: str | Path, cfg: ModelConfig, shard: TpShard, grouped_int8: bool) -> None:
        reader = open_gguf(path)
        self.permuted = GGUF_MODEL_TYPES[architecture(reader)] in PERMUTED_QK
        self.heads = {"attn_q": cfg.num_heads, "attn_k": cfg.num_kv_heads}
        # GGUF name -> (the HF name of the weight it is, its tensor, llama.cpp's kind), for each
        # layer's weight matrix.
        self.tensors = {
            tensor.name: (name, tensor, kind)
            for tensor, name, kind in weight_tensors(reader)
            if kind is not None and name.endswith(".weight")
        }
        self.parts = linear_parts(cfg, shard, ((name, key) for key, (name, _, _) in self.tensors.items()))
        self.kept_types = KEPT_TYPES if grouped_int8 else INT4_TYPES
        types = {
            ours: {self.tensors[key][1].tensor_type.name for _, key in found}
            for ours, found in self.parts.items()
        }
        self.weights = {f"{ours}.weight" for ours, kinds in types.items() if kinds <= set(self.kept_types)}
        self.dequantized_types = sorted(set().union(*types.values()) & set(KEPT_TYPES) - set(self.kept_types))

    def _read(self, key: str) -> Int4Blocks | None:
        _, tensor, kind = self.tensors[key]
        name = tensor.tensor_type.name
        if name not in self.kept_types:
            return None
        blocks = int4_blocks(tensor) if name in INT4_TYPES else int8_blocks(tensor)
        if self.permuted and kind in self.heads:  # rows: each row's groups move with it
            return type(blocks)(*(unpermute_qk(b, self.heads[kind]) for b in blocks[:3]))
        return blocks

    def keep(self, model: nn.Module) -> tuple[int, int]:
        """Build each of ``model``'s linears ``weights`` names from the file's blocks
        (``quant.kept_linear``); returns (kept, left as floats)."""
        kept, _, _ = build_linears(model, self.parts, self._read, keep=True)
        return kept, len(list(decoder_linears(model)))
