"""The KV pools as tensors (Python owns them; Rust owns their block ids). Both pools share one
layout, K and V each ``[num_layers, num_blocks, num_kv_heads, block_size, head_dim]`` in the
model dtype: the device pool on the model's device, the host pool in CPU memory."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from neo_rs._core import advise_huge_pages

Slots = tuple[torch.Tensor, torch.Tensor]  # block ids and in-block offsets, one per token


@dataclass(frozen=True)
class KvLayout:
    num_layers: int
    num_kv_heads: int
    block_size: int
    head_dim: int
    dtype: torch.dtype

    def bytes_per_block(self) -> int:
        """K and V of one block, all layers."""
        elem = torch.empty((), dtype=self.dtype).element_size()
        return 2 * self.num_layers * self.num_kv_heads * self.block_size * self.head_dim * elem


class KvPool:
    def __init__(self, layout: KvLayout, num_blocks: int, device: torch.device) -> None:
        self.layout = layout
        self.num_blocks = num_blocks
        self.device = device
        shape = (layout.num_layers, num_blocks, layout.num_kv_heads, layout.block_size, layout.head_dim)
        # torch.empty never zero-fills: a host pool costs nothing until its pages are used. It is
        # never pinned: every device<->host copy stages through pinned buffers from torch's
        # caching host allocator (``transfer.py``), and the host side is a scatter or gather in
        # host memory. Pinning tens of GiB would take minutes at start-up, lock the memory and
        # may fail; this way start-up stays instant on any host.
        self.k = torch.empty(shape, dtype=layout.dtype, device=device)
        self.v = torch.empty(shape, dtype=layout.dtype, device=device)
        if device.type == "cpu":
            # Before the first write: fewer TLB misses on the CPU kernel's scattered tiles (worth
            # 0-10% here).
            advise_huge_pages(self.k)
            advise_huge_pages(self.v)

    def write(self, layer: int, slots: Slots, k: torch.Tensor, v: torch.Tensor) -> None:
        """Store each token's ``[kv_heads, head_dim]`` K/V at its (block, offset) slot."""
        block, offset = slots
        self.k[layer][block, :, offset] = k
        self.v[layer][block, :, offset] = v


def split_slots(slot_mapping: np.ndarray, block_size: int) -> Slots:
    """Flat slots ``block * block_size + offset`` as (block, offset) index tensors (host)."""
    flat = torch.from_numpy(np.ascontiguousarray(slot_mapping))
    return flat // block_size, flat % block_size


def block_pairs(pairs: np.ndarray, src: KvPool, dst: KvPool) -> tuple[torch.Tensor, torch.Tensor]:
    """Source and destination block indices of ``[n, 2]`` pairs, each on its pool's device."""
    idx = torch.from_numpy(np.ascontiguousarray(pairs))
    return idx[:, 0].to(src.device), idx[:, 1].to(dst.device)
