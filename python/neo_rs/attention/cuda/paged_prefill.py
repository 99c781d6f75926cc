"""Prefill attention over the paged KV pools in Triton, for a chunk whose earlier tokens are only
in the pool (a later chunk of a chunked prefill, or a prompt after its cached prefix): the chunk's
rows attend causally over every token up to their own position, read in place from the per-layer
pools ``[num_blocks, num_kv_heads, block_size, head_dim]`` (the chunk's own K/V is written there
first), with no gather of the context. One program per (tile of rows, query head), FlashAttention
style: an online softmax in float32 over tiles of tokens, whose pages come from the block table.
bfloat16 is read as raw 16-bit words and widened by a shift, as in ``paged_decode.py``, so that
the kernel also runs under Triton's CPU interpreter, where CI tests it."""

from __future__ import annotations

from typing import Any

import torch
import triton
import triton.language as tl

from neo_rs.attention.cuda.checks import check_paged_args
from neo_rs.attention.cuda.paged_decode import _bits, _softcap, _widen

BLOCK_M = 16  # query rows per program
_EMPTY = tl.constexpr(-1e30)  # the running max before any token (finite: exp(m - m) never sees inf - inf)


@triton.jit
def _paged_prefill(
    q_ptr, k_ptr, v_ptr, table_ptr, out_ptr,
    scale, window, softcap, num_computed, seq_len, num_rows,
    stride_qt, stride_qh,
    stride_kb, stride_kh, stride_kt,
    stride_ot, stride_oh,
    GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_SIZE: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
    IS_BF16: tl.constexpr, PRECISION: tl.constexpr, HAS_WINDOW: tl.constexpr, HAS_SOFTCAP: tl.constexpr,
):  # fmt: skip
    tile, head = tl.program_id(0), tl.program_id(1)
    kv_head = head // GROUP
    rows = tile * BLOCK_M + tl.arange(0, BLOCK_M)
    d = tl.arange(0, BLOCK_D)
    r_ok, d_ok = rows < num_rows, d < HEAD_DIM
    q = tl.load(
        q_ptr + rows[:, None] * stride_qt + head * stride_qh + d[None, :], r_ok[:, None] & d_ok[None, :], 0
    )
    q = _widen(q, IS_BF16) * scale
    pos_q = num_computed + rows
    # Causal: the tile's last row sees up to its own position.
    keys = tl.minimum(num_computed + tl.minimum((tile + 1) * BLOCK_M, num_rows), seq_len)
    m = tl.full([BLOCK_M], _EMPTY, tl.float32)
    lsum = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    n = tl.arange(0, BLOCK_N)
    # Under a sliding window the tile's first row sees from window - 1 positions back.
    lo = tl.maximum(num_computed + tile * BLOCK_M - window + 1, 0) if HAS_WINDOW else 0
    for start in range(lo, keys, BLOCK_N):
        pos = start + n
        t_ok = pos < keys  # slots past the length hold whatever the pool held: never load them
        block = tl.load(table_ptr + pos // BLOCK_SIZE, t_ok, 0).to(tl.int64)
        kv_at = block[:, None] * stride_kb + kv_head * stride_kh + (pos % BLOCK_SIZE)[:, None] * stride_kt
        kv_ok = t_ok[:, None] & d_ok[None, :]
        k = _widen(tl.load(k_ptr + kv_at + d[None, :], kv_ok, 0), IS_BF16)
        v = _widen(tl.load(v_ptr + kv_at + d[None, :], kv_ok, 0), IS_BF16)
        s = tl.dot(q, tl.trans(k), input_precision=PRECISION)  # [BLOCK_M, BLOCK_N]
        if HAS_SOFTCAP:
            s = _softcap(s, softcap)
        seen = t_ok[None, :] & (pos[None, :] <= pos_q[:, None])
        if HAS_WINDOW:
            seen = seen & (pos[None, :] > pos_q[:, None] - window)
        s = tl.where(seen, s, float("-inf"))
        m_new = tl.maximum(m, tl.max(s, axis=1))
        p = tl.exp(s - m_new[:, None])
        alpha = tl.exp(m - m_new)
        lsum = lsum * alpha + tl.sum(p, axis=1)
        acc = acc * alpha[:, None] + tl.dot(p, v, input_precision=PRECISION)
        m = m_new
    out = acc / tl.maximum(lsum, 1e-30)[:, None]
    tl.store(
        out_ptr + rows[:, None] * stride_ot + head * stride_oh + d[None, :],
        out,
        r_ok[:, None] & d_ok[None, :],
    )


def prefill_launch(
    group: int,
    head_dim: int,
    block_size: int,
    dtype: torch.dtype,
    window: bool = False,
    softcap: bool = False,
) -> dict[str, Any]:
    """The prefill kernel's compile-time arguments for one model shape and dtype, as
    ``benches/gpu_compile.py`` compiles them for each GPU target."""
    block_d = max(16, triton.next_power_of_2(head_dim))
    # Tokens per tile: a block's worth, but 16 for float32 and past head dim 128 (32 spilled
    # registers, and took 80 KiB of a T4's 64 KiB of shared memory at head dim 256).
    block_n = 16 if dtype == torch.float32 or block_d > 128 else max(16, block_size)
    return dict(
        GROUP=group,
        HEAD_DIM=head_dim,
        BLOCK_SIZE=block_size,
        BLOCK_M=BLOCK_M,
        BLOCK_N=block_n,
        BLOCK_D=block_d,
        IS_BF16=dtype == torch.bfloat16,
        # 16-bit inputs are exact in tf32, and the probabilities lose no more there than
        # FlashAttention's rounding to the model dtype; float32 models keep full precision.
        PRECISION="ieee" if dtype == torch.float32 else "tf32",
        HAS_WINDOW=window,
        HAS_SOFTCAP=softcap,
        # At 4 warps some targets spilled (sm_75 at head dim 64, sm_80 at 256); at 8 none did,
        # with a third fewer registers, but for float32 past head dim 128 with a window or a cap
        # (24 bytes on sm_86/89), where 16 spill nowhere (benches/gpu_compile.py).
        num_warps=16 if (window or softcap) and dtype == torch.float32 and block_d > 128 else 8,
    )


@torch.library.custom_op("neo_rs::paged_prefill", mutates_args=())
def paged_prefill(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_table: torch.Tensor,
    num_computed: int,
    seq_len: int,
    scale: float,
    window: int = 0,
    softcap: float = 0.0,
) -> torch.Tensor:
    """Causal attention of a chunk's rows ``q`` ``[rows, q_heads, head_dim]`` (positions
    ``num_computed .. seq_len``) over one layer's pools, through token ``seq_len - 1``;
    ``block_table`` holds the sequence's block ids (at least ``seq_len / block_size`` of them)
    on the pools' device. Returns ``[rows, q_heads, head_dim]`` in ``q``'s dtype. ``window`` and
    ``softcap`` as for ``paged_decode``. A torch custom op, as ``paged_decode`` is."""
    rows, num_heads, head_dim = q.shape
    _, num_kv_heads, block_size, _ = k_cache.shape
    assert rows == seq_len - num_computed and k_cache.stride() == v_cache.stride() and k_cache.stride(-1) == 1
    q = q.contiguous()
    out = torch.empty(q.shape, dtype=torch.float32, device=q.device)
    if rows == 0:
        return out.to(q.dtype)
    _paged_prefill[(triton.cdiv(rows, BLOCK_M), num_heads)](
        _bits(q), _bits(k_cache), _bits(v_cache), block_table, out,
        scale, window, softcap, num_computed, seq_len, rows,
        q.stride(0), q.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        out.stride(0), out.stride(1),
        **prefill_launch(num_heads // num_kv_heads, head_dim, block_size, q.dtype, window > 0, softcap > 0),
    )  # fmt: skip
    return out.to(q.dtype)


@paged_prefill.register_fake
def _(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_table: torch.Tensor,
    num_computed: int,
    seq_len: int,
    scale: float,
    window: int = 0,
    softcap: float = 0.0,
) -> torch.Tensor:
    check_paged_args(q, k_cache, v_cache, block_table)
    if q.shape[0] != seq_len - num_computed:
        raise ValueError(f"paged_prefill: {q.shape[0]} rows for positions {num_computed}..{seq_len}")
    return torch.empty_like(q)
