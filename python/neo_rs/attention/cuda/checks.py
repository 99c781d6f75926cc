"""What the Triton kernels' launches take for granted, checked where torch runs them on fake
tensors (their ops' fake implementations): a kernel reads raw pointers, so a host tensor among
its arguments or a pool of another dtype would be read as garbage on a GPU, not refused."""

from __future__ import annotations

import torch


def check_paged_args(
    q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, *rest: torch.Tensor
) -> None:
    """One device for all; ``q``, the pools (and a given output) in one float dtype; the block
    tables and lengths integers; ``q`` ``[rows, heads, head_dim]`` over pools ``[blocks,
    kv_heads, block_size, head_dim]`` with a whole number of query heads per KV head."""
    named = {"q": q, "k_cache": k_cache, "v_cache": v_cache, **{f"arg{i}": t for i, t in enumerate(rest, 4)}}
    devices = {name: t.device for name, t in named.items()}
    if len(set(devices.values())) > 1:
        raise ValueError(f"paged attention arguments on different devices: {devices}")
    floats = [t for t in (q, k_cache, v_cache, *rest) if t.is_floating_point()]
    if len({t.dtype for t in floats}) > 1:
        raise ValueError(f"paged attention over mixed dtypes: {[t.dtype for t in floats]}")
    if any(not t.is_floating_point() and t.dtype not in (torch.int32, torch.int64) for t in rest):
        raise ValueError("block tables and lengths must be int32 or int64")
    if q.dim() != 3 or k_cache.dim() != 4 or k_cache.shape != v_cache.shape:
        raise ValueError(f"paged attention shapes: q {tuple(q.shape)}, pools {tuple(k_cache.shape)}")
    if q.shape[2] != k_cache.shape[3] or q.shape[1] % k_cache.shape[1]:
        raise ValueError(f"q {tuple(q.shape)} does not fit pools of {tuple(k_cache.shape)}")
