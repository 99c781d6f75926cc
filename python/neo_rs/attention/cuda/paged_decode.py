"""Paged decode attention in Triton, reading the per-layer KV pools in place
(``[num_blocks, num_kv_heads, block_size, head_dim]``, no gather copies): one program per
(sequence, KV head, split) attends every query head of the GQA group over its share of the
sequence's blocks with an online softmax in float32; long sequences are split (FlashDecoding) and
the splits merged by their log-sum-exp. vLLM's Triton decode kernel is the model. bfloat16 is read
as raw 16-bit words and widened by a shift, which is exact and also runs under Triton's CPU
interpreter (``TRITON_INTERPRET=1``), where CI tests this kernel against the Rust one."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import triton
import triton.language as tl

from neo_rs.attention.cuda.checks import check_paged_args

# Blocks one program walks before the sequence is split further; at most MAX_SPLITS splits.
BLOCKS_PER_SPLIT = 32
MAX_SPLITS = 16
# f32 values of a q·k or p·v broadcast product per thread (see decode_launch).
PRODUCT_PER_THREAD = 16
_EMPTY = tl.constexpr(-1e30)  # the running max before any token (finite: exp(m - m) never sees inf - inf)


@dataclass(frozen=True)
class SplitPlan:
    """How many pieces each sequence's blocks are cut into; the same for every layer of one
    iteration's sub-batch, so it is built once from the host-side lengths (no device sync)."""

    num_splits: int
    blocks_per_split: int

    @staticmethod
    def for_lengths(max_seq_len: int, block_size: int) -> SplitPlan:
        max_blocks = max(1, triton.cdiv(max_seq_len, block_size))
        splits = min(MAX_SPLITS, triton.cdiv(max_blocks, BLOCKS_PER_SPLIT))
        return SplitPlan(splits, triton.cdiv(max_blocks, splits))


@triton.jit
def _widen(x, IS_BF16: tl.constexpr):
    if IS_BF16:
        return (x.to(tl.uint16).to(tl.uint32) << 16).to(tl.float32, bitcast=True)
    return x.to(tl.float32)


@triton.jit
def _softcap(s, cap):
    """``cap * tanh(s / cap)``, as 2·sigmoid(2x) - 1 (one exp; saturates to ±1 without inf - inf)."""
    return cap * (2 * tl.sigmoid(2 * s / cap) - 1)


@triton.jit
def _paged_decode_split(
    q_ptr, k_ptr, v_ptr, tables_ptr, lens_ptr, acc_ptr, m_ptr, l_ptr,
    scale, window, softcap, max_blocks, blocks_per_split,
    stride_qs, stride_qh,
    stride_kb, stride_kh, stride_kt,
    stride_as, stride_ah, stride_ap,
    stride_ms, stride_mh,
    GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_SIZE: tl.constexpr,
    BLOCK_G: tl.constexpr, BLOCK_D: tl.constexpr, TOKENS: tl.constexpr, IS_BF16: tl.constexpr,
    HAS_WINDOW: tl.constexpr, HAS_SOFTCAP: tl.constexpr,
):  # fmt: skip
    seq, kv_head, split = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    g = tl.arange(0, BLOCK_G)
    d = tl.arange(0, BLOCK_D)
    t = tl.arange(0, TOKENS)
    g_ok, d_ok = g < GROUP, d < HEAD_DIM
    heads = kv_head * GROUP + g
    q = tl.load(
        q_ptr + seq * stride_qs + heads[:, None] * stride_qh + d[None, :], g_ok[:, None] & d_ok[None, :], 0
    )
    q = _widen(q, IS_BF16) * scale
    seq_len = tl.load(lens_ptr + seq)
    # The split's blocks, walked TOKENS rows at a time (a block's rows in several tiles when the
    # group x tokens x head-dim products would not fit in registers).
    tiles = BLOCK_SIZE // TOKENS
    # Under a sliding window the splits start at the block of the first attended position.
    lo = tl.maximum(seq_len - window, 0) if HAS_WINDOW else 0
    first = (lo // BLOCK_SIZE + split * blocks_per_split) * tiles
    last = tl.minimum(first + blocks_per_split * tiles, tl.cdiv(seq_len, TOKENS))
    m = tl.full([BLOCK_G], _EMPTY, tl.float32)
    lsum = tl.zeros([BLOCK_G], tl.float32)
    acc = tl.zeros([BLOCK_G, BLOCK_D], tl.float32)
    for i in range(first, last):
        block = tl.load(tables_ptr + seq * max_blocks + i // tiles).to(tl.int64)
        row = (i % tiles) * TOKENS + t
        pos = i * TOKENS + t
        t_ok = (pos < seq_len) & (pos >= lo)  # slots past the length hold whatever the pool held
        kv_at = block * stride_kb + kv_head * stride_kh + row[:, None] * stride_kt + d[None, :]
        kv_ok = t_ok[:, None] & d_ok[None, :]
        k = _widen(tl.load(k_ptr + kv_at, kv_ok, 0), IS_BF16)
        v = _widen(tl.load(v_ptr + kv_at, kv_ok, 0), IS_BF16)
        s = tl.sum(q[:, None, :] * k[None, :, :], axis=2)  # [G, TOKENS]
        if HAS_SOFTCAP:
            s = _softcap(s, softcap)
        s = tl.where(t_ok[None, :], s, float("-inf"))
        m_new = tl.maximum(m, tl.max(s, axis=1))
        p = tl.exp(s - m_new[:, None])
        alpha = tl.exp(m - m_new)
        lsum = lsum * alpha + tl.sum(p, axis=1)
        acc = acc * alpha[:, None] + tl.sum(p[:, :, None] * v[None, :, :], axis=1)
        m = m_new
    out_at = seq * stride_as + heads[:, None] * stride_ah + split * stride_ap + d[None, :]
    tl.store(acc_ptr + out_at, acc, g_ok[:, None] & d_ok[None, :])
    ml_at = seq * stride_ms + heads * stride_mh + split
    tl.store(m_ptr + ml_at, m, g_ok)
    tl.store(l_ptr + ml_at, lsum, g_ok)


def _bits(t: torch.Tensor) -> torch.Tensor:
    """bfloat16 as its 16-bit words (the kernel widens them); other dtypes as they are."""
    return t.view(torch.int16) if t.dtype == torch.bfloat16 else t


def decode_launch(
    group: int,
    head_dim: int,
    block_size: int,
    dtype: torch.dtype,
    window: bool = False,
    softcap: bool = False,
) -> dict[str, Any]:
    """The decode kernel's compile-time arguments for one model shape and dtype: its constants and
    warps, as ``benches/gpu_compile.py`` compiles them for each GPU target. q·k and p·v are
    broadcast products of ``[group, tokens, head_dim]`` f32 values, held in registers: tiles of
    ``TOKENS`` rows keep them to ``PRODUCT_PER_THREAD`` values a thread (whole blocks of 32 rows
    at group 8 spilled kilobytes on sm_90)."""
    block_g, block_d = triton.next_power_of_2(group), triton.next_power_of_2(head_dim)
    warps = 4 if block_g * block_d <= 512 else 8
    tokens = max(1, PRODUCT_PER_THREAD * 32 * warps // (block_g * block_d))
    return dict(
        GROUP=group,
        HEAD_DIM=head_dim,
        BLOCK_SIZE=block_size,
        BLOCK_G=block_g,
        BLOCK_D=block_d,
        TOKENS=min(block_size, triton.next_power_of_2(tokens + 1) // 2),  # a power of two, at most
        IS_BF16=dtype == torch.bfloat16,
        HAS_WINDOW=window,
        HAS_SOFTCAP=softcap,
        num_warps=warps,
    )


def _split_scratch(q: torch.Tensor, splits: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per split: the unnormalised output, and (running max, sum of exponentials), in float32."""
    num_seqs, num_heads, head_dim = q.shape
    acc = torch.empty(num_seqs, num_heads, splits, head_dim, dtype=torch.float32, device=q.device)
    m = torch.empty(num_seqs, num_heads, splits, dtype=torch.float32, device=q.device)
    return acc, m, torch.empty_like(m)


@torch.library.custom_op("neo_rs::paged_decode", mutates_args=("out",))
def paged_decode(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    out: torch.Tensor,
    num_splits: int,
    blocks_per_split: int,
    window: int = 0,
    softcap: float = 0.0,
) -> None:
    """Decode attention of ``q`` ``[seqs, q_heads, head_dim]`` over one layer's pools into ``out``;
    ``block_tables`` ``[seqs, max_blocks]`` and ``seq_lens`` ``[seqs]`` are int32 on the pools'
    device; each sequence's blocks cut as a ``SplitPlan`` says. A sequence of length 0 gets
    zeros. ``window`` > 0: each attends to its last ``window`` positions only; ``softcap`` > 0:
    scaled scores become ``softcap · tanh(score / softcap)``. A torch custom op, so that torch
    sees one opaque call (fake tensors check its arguments, ``check_paged_args``; graphs and
    compilers keep it whole)."""
    num_seqs, num_heads, head_dim = q.shape
    _, num_kv_heads, block_size, _ = k_cache.shape
    if num_seqs == 0:
        return
    assert k_cache.stride() == v_cache.stride() and k_cache.stride(-1) == 1 and q.stride(-1) == 1
    splits = num_splits
    acc, m, lsum = _split_scratch(q, splits)
    _paged_decode_split[(num_seqs, num_kv_heads, splits)](
        _bits(q), _bits(k_cache), _bits(v_cache), block_tables, seq_lens, acc, m, lsum,
        scale, window, softcap, block_tables.shape[1], blocks_per_split,
        q.stride(0), q.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        acc.stride(0), acc.stride(1), acc.stride(2),
        m.stride(0), m.stride(1),
        **decode_launch(num_heads // num_kv_heads, head_dim, block_size, q.dtype, window > 0, softcap > 0),
    )  # fmt: skip
    # Merge the splits by their log-sum-exp; empty splits (and empty sequences) weigh nothing.
    weight = torch.exp(m - m.max(dim=2, keepdim=True).values) * (lsum > 0)
    total = (weight * lsum).sum(dim=2, keepdim=True)
    merged = (weight[..., None] * acc).sum(dim=2) / total.clamp_min(torch.finfo(torch.float32).tiny)
    out.copy_(merged)


@paged_decode.register_fake
def _(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    out: torch.Tensor,
    num_splits: int,
    blocks_per_split: int,
    window: int = 0,
    softcap: float = 0.0,
) -> None:
    check_paged_args(q, k_cache, v_cache, block_tables, seq_lens, out)
    if out.shape != q.shape or seq_lens.shape != (q.shape[0],) or block_tables.shape[0] != q.shape[0]:
        raise ValueError(
            f"paged_decode: q {tuple(q.shape)}, out {tuple(out.shape)}, block tables "
            f"{tuple(block_tables.shape)} and lengths {tuple(seq_lens.shape)} disagree on the rows"
        )
    _split_scratch(q, num_splits)  # what the kernel allocates, for a memory trace to see
