"""GGUF's 4-bit block types kept quantized (``--quantization gguf``, inferred for a ``.gguf``
model): Q4_0, Q4_1 and Q4_K store each block of 32 weights of a row as 4-bit values ``q`` with
one scale and one offset (Q4_K's come from its super-block's 6-bit sub-scales), which is exactly
``Int4Linear``'s form in groups of 32, ``w = (q - 8) * scale + zero``. So the decoder linears
whose every part the file stores so are rebuilt from the file's blocks, with no requantization
(the scales in the model dtype); the others keep the weights the conversion dequantized.

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
from neo_rs.model.quant import Int4Blocks, decoder_linears
from neo_rs.parallel.shards import TpShard

GROUP = 32
KEPT_TYPES = ("Q4_0", "Q4_1", "Q4_K")


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


class GgufBlocks:
    """GGUF ``path``'s 4-bit blocks for rank ``shard``: ``weights``, our weights
    (``layers.N.qkv_proj.weight``...) whose every part the file stores in a kept type, for the
    loader to leave unallocated; then ``keep`` builds those linears. The file is opened once (its
    metadata takes seconds to parse)."""

    def __init__(self, path: str | Path, cfg: ModelConfig, shard: TpShard) -> None:
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
        self.weights = {
            f"{ours}.weight"
            for ours, found in self.parts.items()
            if all(self.tensors[key][1].tensor_type.name in KEPT_TYPES for _, key in found)
        }

    def _read(self, key: str) -> Int4Blocks | None:
        _, tensor, kind = self.tensors[key]
        if tensor.tensor_type.name not in KEPT_TYPES:
            return None
        blocks = int4_blocks(tensor)
        if self.permuted and kind in self.heads:  # rows: each row's groups move with it
            return Int4Blocks(*(unpermute_qk(b, self.heads[kind]) for b in blocks[:3]))
        return blocks

    def keep(self, model: nn.Module) -> tuple[int, int]:
        """Build each of ``model``'s linears ``weights`` names as an ``Int4Linear`` of the file's
        blocks; returns (kept, left as floats)."""
        kept, _, _ = build_linears(model, self.parts, self._read, keep=True)
        return kept, len(list(decoder_linears(model)))
