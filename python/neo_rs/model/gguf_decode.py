"""A GGUF tensor's blocks read as the integer values, scales and offsets they hold, in the forms
our kernels keep (``gguf_blocks.py``): ``Int4Blocks`` for Q4_0, Q4_1 and Q4_K (``w = (q - 8) *
scale + zero``, groups of 32), ``Int8Blocks`` for Q8_0, Q5_0, Q5_1 and Q5_K (``w = q * scale +
zero``, groups of 32) and for Q2_K, Q3_K and Q6_K (groups of 16). Each is exactly what ``gguf``
dequantizes, in float32: the same products, an offset added or subtracted as it does. The layouts
are llama.cpp's (``ggml-quants.c``), as ``gguf.quants`` reads them."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
import torch
from gguf.quants import Q4_K

from neo_rs.model.quant import Int4Blocks, Int8Blocks

INT4_TYPES = ("Q4_0", "Q4_1", "Q4_K")
INT8_TYPES = ("Q8_0", "Q5_0", "Q5_1", "Q5_K", "Q2_K", "Q3_K", "Q6_K")

# A block's values q, scales and offsets (None: zeros), each [blocks, ...] in the weight's order:
# w = q * scale + offset.
Decoded = tuple[np.ndarray, np.ndarray, np.ndarray | None]


def _f16(blocks: np.ndarray, at: int) -> np.ndarray:
    """The fp16 field at byte ``at`` of each block, as float32 ``[n, 1]``."""
    return blocks[:, at : at + 2].copy().view(np.float16).astype(np.float32)


def _split(data: np.ndarray, width: int, bits: int) -> np.ndarray:
    """Each run of ``width`` bytes of ``data`` (uint8 ``[n, ...]``) as its values of ``bits``:
    value ``v`` of a run's byte ``j`` (bits ``v * bits`` up) at ``v * width + j`` of the run's."""
    shifts = np.arange(0, 8, bits, dtype=np.uint8).reshape(1, 1, -1, 1)
    values = (data.reshape(len(data), -1, 1, width) >> shifts) & np.uint8((1 << bits) - 1)
    return values.reshape(len(data), -1)


def _q4_0(b: np.ndarray) -> Decoded:  # d, 16 bytes of nibbles; w = d * (q - 8)
    d = _f16(b, 0)
    return _split(b[:, 2:], 16, 4), d, -8 * d


def _q4_1(b: np.ndarray) -> Decoded:  # d, m, 16 bytes of nibbles
    return _split(b[:, 4:], 16, 4), _f16(b, 0), _f16(b, 2)


def _k_scales(b: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Q4_K's and Q5_K's per-32 scales and offsets: d, dmin, then 12 bytes of 6-bit sub-scales
    and mins; w = q * d * scale - dmin * min."""
    sc, mn = Q4_K.get_scale_min(b[:, 4:16])
    return _f16(b, 0) * sc.astype(np.float32), -(_f16(b, 2) * mn.astype(np.float32))


def _q4_k(b: np.ndarray) -> Decoded:
    # Super-blocks of 256: the scales, then 128 bytes of nibbles (each 32 bytes two sub-blocks).
    return _split(b[:, 16:], 32, 4), *_k_scales(b)


def _q8_0(b: np.ndarray) -> Decoded:  # d, 32 int8
    return b[:, 2:].view(np.int8), _f16(b, 0), None


def _five_bits(b: np.ndarray, at: int) -> np.ndarray:
    """Q5_0's and Q5_1's 32 values from byte ``at``: 4 bytes of fifth bits (element ``j``'s in
    bit ``j``, little-endian), then 16 bytes of nibbles."""
    fifth = (b[:, at : at + 4].copy().view("<u4") >> np.arange(32, dtype=np.uint32)) & 1
    return _split(b[:, at + 4 :], 16, 4) | (fifth.astype(np.uint8) << 4)


def _q5_0(b: np.ndarray) -> Decoded:  # d, fifth bits, nibbles; w = d * (q - 16)
    return _five_bits(b, 2).astype(np.int8) - 16, _f16(b, 0), None


def _q5_1(b: np.ndarray) -> Decoded:  # d, m, fifth bits, nibbles; w = d * q + m
    return _five_bits(b, 4).astype(np.int8), _f16(b, 0), _f16(b, 2)


def _q5_k(b: np.ndarray) -> Decoded:
    # As Q4_K, with 32 bytes of fifth bits (bit s of byte j: sub-block s's element j) before the
    # nibbles.
    q = _split(b[:, 48:], 32, 4) | _split(b[:, 16:48], 32, 1) << 4
    return q.astype(np.int8), *_k_scales(b)


def _q2_k(b: np.ndarray) -> Decoded:
    # 16 bytes of 4-bit scale (low) and min (high) per 16 values, 64 bytes of 2-bit values, d,
    # dmin; w = q * d * scale - dmin * min.
    sub = b[:, :16]
    scale = _f16(b, 80) * (sub & 0x0F).astype(np.float32)
    return _split(b[:, 16:80], 32, 2).astype(np.int8), scale, -(_f16(b, 82) * (sub >> 4).astype(np.float32))


def _q3_k(b: np.ndarray) -> Decoded:
    # 32 bytes of high-bit masks, 64 of 2-bit values, 12 of 6-bit scales (low nibbles of bytes
    # 0-7, then 2-bit pairs of bytes 8-11), d; w = d * (scale - 32) * (low - 4 * (1 - high)).
    sub = _split(b[:, 96:104], 8, 4) | _split(b[:, 104:108], 4, 2) << 4
    q = _split(b[:, 32:96], 32, 2).astype(np.int8) - 4 * (1 - _split(b[:, :32], 32, 1)).astype(np.int8)
    return q, _f16(b, 108) * (sub.astype(np.int8) - 32).astype(np.float32), None


def _q6_k(b: np.ndarray) -> Decoded:
    # 128 bytes of low nibbles, 64 of high 2-bit pairs, 16 int8 scales (one per 16 values), d.
    q = _split(b[:, :128], 64, 4) | _split(b[:, 128:192], 32, 2) << 4
    return q.astype(np.int8) - 32, _f16(b, 208) * b[:, 192:208].view(np.int8).astype(np.float32), None


# Type -> (bytes a block, its decoder).
_DECODERS: dict[str, tuple[int, Callable[[np.ndarray], Decoded]]] = {
    "Q4_0": (18, _q4_0),
    "Q4_1": (20, _q4_1),
    "Q4_K": (144, _q4_k),
    "Q8_0": (34, _q8_0),
    "Q5_0": (22, _q5_0),
    "Q5_1": (24, _q5_1),
    "Q5_K": (176, _q5_k),
    "Q2_K": (84, _q2_k),
    "Q3_K": (110, _q3_k),
    "Q6_K": (210, _q6_k),
}


def decoded_blocks(tensor: Any) -> Int4Blocks:
    """A tensor of one of ``INT4_TYPES`` or ``INT8_TYPES`` (``[rows, cols]``) as ``Int4Blocks``
    (``q`` uint8 0..15) or ``Int8Blocks`` (``q`` int8), ``scale`` and ``zero`` float32 ``[rows,
    groups]``."""
    kind = tensor.tensor_type.name
    rows = int(tensor.shape[-1])  # gguf lists the shape innermost first
    size, decode = _DECODERS[kind]
    q, scale, offset = decode(np.asarray(tensor.data, dtype=np.uint8).reshape(-1, size))
    zero = np.zeros_like(scale) if offset is None else offset
    if kind in INT4_TYPES:  # as (q - 8) * scale + zero
        zero = zero + 8 * scale
    q_t, scale_t, zero_t = (
        torch.from_numpy(np.ascontiguousarray(a).reshape(rows, -1)) for a in (q, scale, zero)
    )
    return (Int4Blocks if kind in INT4_TYPES else Int8Blocks)(q_t, scale_t, zero_t)
