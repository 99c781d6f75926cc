"""An MoE layer's experts on CUDA in Triton, after vLLM's fused-MoE design: the (token, slot)
pairs are sorted by expert and each expert's run padded to a whole tile (``align``), then one
grouped GEMM per projection covers every expert: each program takes one tile of one expert's rows
and a tile of output columns, gathering its rows through the sorted ids.

Nothing here reads the device back: the sort, the padding and the tile-to-expert map are tensor
ops into buffers sized for the worst case (every expert's last tile part-filled), and the grid is
that worst case, its surplus programs returning at once. bfloat16 is read as raw 16-bit words and
widened by a shift, as in the attention kernels, so that the kernel also runs under Triton's CPU
interpreter, where CI tests it against the torch path."""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from neo_rs.model.cuda.words import as_words, widen

BLOCK_M = 16  # pair rows per tile: tl.dot's minimum


@triton.jit
def _moe_gemm(
    a_ptr, w_ptr, out_ptr, sorted_ptr, block_expert_ptr,
    num_pairs, N, K,
    stride_am, stride_we, stride_wn, stride_om,
    ROWS_PER_TOKEN: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    IS_BF16: tl.constexpr, PRECISION: tl.constexpr,
):  # fmt: skip
    tile, col_tile = tl.program_id(0), tl.program_id(1)
    expert = tl.load(block_expert_ptr + tile)
    if expert >= 0:  # tiles past the last expert's run are the grid's surplus
        pair = tl.load(sorted_ptr + tile * BLOCK_M + tl.arange(0, BLOCK_M))
        ok = pair < num_pairs  # the padding of a part-filled tile holds num_pairs
        row = pair // ROWS_PER_TOKEN  # the first GEMM reads each token once per slot
        n = col_tile * BLOCK_N + tl.arange(0, BLOCK_N)
        n_ok = n < N
        acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
        for k0 in range(0, K, BLOCK_K):
            kk = k0 + tl.arange(0, BLOCK_K)
            k_ok = kk < K
            a = tl.load(a_ptr + row[:, None] * stride_am + kk[None, :], ok[:, None] & k_ok[None, :], 0)
            w_at = w_ptr + expert.to(tl.int64) * stride_we + n[None, :] * stride_wn + kk[:, None]
            w = tl.load(w_at, k_ok[:, None] & n_ok[None, :], 0)  # [BLOCK_K, BLOCK_N]
            acc += tl.dot(widen(a, IS_BF16), widen(w, IS_BF16), input_precision=PRECISION)
        tl.store(out_ptr + pair[:, None] * stride_om + n[None, :], acc, ok[:, None] & n_ok[None, :])


def moe_launch(dtype: torch.dtype) -> dict[str, Any]:
    """The grouped GEMM's compile-time arguments for a dtype, as ``benches/gpu_compile.py``
    compiles them for each GPU target."""
    return dict(
        BLOCK_M=BLOCK_M,
        BLOCK_N=64,
        BLOCK_K=32,
        IS_BF16=dtype == torch.bfloat16,
        # 16-bit inputs are exact in tf32; float32 models keep full precision.
        PRECISION="ieee" if dtype == torch.float32 else "tf32",
        num_warps=4,
    )


def align(chosen: torch.Tensor, num_experts: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The pairs ``chosen`` (each one's expert, ``[pairs]``) sorted by expert, each expert's run
    padded to a multiple of ``BLOCK_M`` with the id ``pairs``; and each tile's expert (-1 past the
    last run). Both are sized for the worst case, so nothing is read back."""
    pairs = chosen.numel()
    capacity = -(-(pairs + num_experts * (BLOCK_M - 1)) // BLOCK_M) * BLOCK_M
    ones = torch.ones_like(chosen)
    counts = torch.zeros(num_experts, dtype=chosen.dtype, device=chosen.device).scatter_add_(0, chosen, ones)
    padded = (counts + BLOCK_M - 1) // BLOCK_M * BLOCK_M
    ends = padded.cumsum(0)
    order = chosen.argsort(stable=True)
    expert = chosen[order]
    # Each pair's place: its expert's run start, plus its rank among that expert's pairs.
    rank = torch.arange(pairs, device=chosen.device) - (counts.cumsum(0) - counts)[expert]
    sorted_ids = torch.full((capacity,), pairs, dtype=torch.int32, device=chosen.device)
    sorted_ids[(ends - padded)[expert] + rank] = order.to(torch.int32)
    starts = torch.arange(0, capacity, BLOCK_M, device=chosen.device)
    tiles = torch.searchsorted(ends, starts, right=True)
    return sorted_ids, torch.where(tiles < num_experts, tiles, -1).to(torch.int32)


@torch.library.custom_op("neo_rs::moe_gemm", mutates_args=())
def moe_gemm(
    a: torch.Tensor,
    w: torch.Tensor,
    sorted_ids: torch.Tensor,
    tile_experts: torch.Tensor,
    rows_per_token: int,
) -> torch.Tensor:
    """``out[p] = a[p // rows_per_token] @ w[expert(p)].T`` for every pair ``p`` (float32
    ``[pairs, N]``), over ``align``'s sorted ids and tile experts; ``w`` ``[experts, N, K]``."""
    pairs = a.shape[0] * rows_per_token
    _, n, k = w.shape
    a, w = a.contiguous(), w.contiguous()
    out = torch.empty(pairs, n, dtype=torch.float32, device=a.device)
    launch = moe_launch(a.dtype)
    grid = (tile_experts.numel(), triton.cdiv(n, launch["BLOCK_N"]))
    _moe_gemm[grid](
        as_words(a), as_words(w), out, sorted_ids, tile_experts,
        pairs, n, k,
        a.stride(0), w.stride(0), w.stride(1), out.stride(0),
        ROWS_PER_TOKEN=rows_per_token, **launch,
    )  # fmt: skip
    return out


@moe_gemm.register_fake
def _(
    a: torch.Tensor,
    w: torch.Tensor,
    sorted_ids: torch.Tensor,
    tile_experts: torch.Tensor,
    rows_per_token: int,
) -> torch.Tensor:
    devices = {t.device for t in (a, w, sorted_ids, tile_experts)}
    if len(devices) > 1:
        raise ValueError(f"moe_gemm arguments on different devices: {devices}")
    if a.dtype != w.dtype or a.dim() != 2 or w.dim() != 3 or a.shape[1] != w.shape[2]:
        raise ValueError(f"moe_gemm: a {a.dtype} {tuple(a.shape)} against w {w.dtype} {tuple(w.shape)}")
    if sorted_ids.dtype != torch.int32 or tile_experts.dtype != torch.int32:
        raise ValueError("moe_gemm: sorted ids and tile experts must be int32")
    return a.new_empty(a.shape[0] * rows_per_token, w.shape[1], dtype=torch.float32)


def fused_moe(
    x: torch.Tensor,
    w_gate_up: torch.Tensor,
    w_down: torch.Tensor,
    experts: torch.Tensor,
    weights: torch.Tensor,
) -> torch.Tensor:
    """The weighted sum of each token's experts (SwiGLU, gate and up stacked in ``w_gate_up``
    ``[experts, 2 I, H]``, ``w_down`` ``[experts, H, I]``); ``experts`` and ``weights``
    ``[tokens, top_k]`` as the router chose them."""
    tokens, top_k = experts.shape
    sorted_ids, tile_experts = align(experts.flatten(), w_gate_up.shape[0])
    gate, up = moe_gemm(x, w_gate_up, sorted_ids, tile_experts, top_k).chunk(2, dim=-1)
    h = (F.silu(gate) * up).to(x.dtype)
    out = moe_gemm(h, w_down, sorted_ids, tile_experts, 1).view(tokens, top_k, -1)
    return (out * weights[..., None]).sum(dim=1).to(x.dtype)
