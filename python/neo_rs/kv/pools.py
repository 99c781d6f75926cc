"""The KV pools as tensors (Python owns them; Rust owns their block ids). Both pools share one
layout, K and V each ``[num_layers, num_blocks, num_kv_heads, block_size, head_dim]``: the device
pool on the model's device in the model dtype, the host pool in CPU memory in the model dtype or
(``cpu_kv_dtype="int8"``) as int8 rows, each token of each KV head with a float32 scale beside its
block, ``[num_layers, num_blocks, num_kv_heads, block_size]``, rows stored rotated (a Hadamard
transform spreads a large channel over the row, so it does not coarsen the others). Every write
into an int8 pool quantizes (``_core.quantize_rows``, the kernel's own rotation and rounding);
reads for the device dequantize (``_core.dequantize_rows``).

In CPU memory, K and V are the two halves of one tensor ``[num_layers, num_blocks, num_kv_heads,
2, block_size, head_dim]`` (scales likewise): a (block, KV head)'s K tile and V tile sit side by
side, so the CPU kernel reads one run per tile pair instead of two runs half as long. On this
project's VMs a decode call over blocks out of the caches ran 1.01-1.17x faster that way (median
1.07x; ``benches/attn_cpu.py --cold --compare-layouts``). CPU pools start on a page boundary
(``page_aligned_empty``), so that a tile pair whose size is a multiple of a page spans no page
more than it must."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from math import prod
from mmap import PAGESIZE
from typing import TypedDict

import numpy as np
import torch

from neo_rs._core import dequantize_rows, quantize_rows

Slots = tuple[torch.Tensor, torch.Tensor]  # block ids and in-block offsets, one per token


class RowScales(TypedDict, total=False):
    """An int8 pool's row scales, as keyword arguments of a CPU attention call."""

    k_scale: torch.Tensor
    v_scale: torch.Tensor


@dataclass(frozen=True)
class KvLayout:
    num_layers: int
    num_kv_heads: int
    block_size: int
    head_dim: int
    dtype: torch.dtype

    def bytes_per_block(self, quantized: bool = False) -> int:
        """K and V of one block, all layers (int8 rows with their float32 scales if ``quantized``)."""
        elem = torch.empty((), dtype=self.dtype).element_size()
        row = self.head_dim + 4 if quantized else self.head_dim * elem
        return 2 * self.num_layers * self.num_kv_heads * self.block_size * row


INT8_POISON = -128  # never produced by quantization (rows are clamped to +-127)


class KvPool:
    def __init__(
        self, layout: KvLayout, num_blocks: int, device: torch.device, quantized: bool = False
    ) -> None:
        self.layout = layout
        self.num_blocks = num_blocks
        self.device = device
        shape = (layout.num_layers, num_blocks, layout.num_kv_heads, layout.block_size, layout.head_dim)
        store = torch.int8 if quantized else layout.dtype
        # torch.empty never zero-fills: a host pool costs nothing until its pages are used. It is
        # never pinned: every device<->host copy stages through pinned buffers from torch's
        # caching host allocator (``kv/transfer.py``), and the host side is a scatter or gather in
        # host memory. Pinning tens of GiB would take minutes at start-up, lock the memory and
        # may fail; this way start-up stays instant on any host.
        # In CPU memory K and V are the halves of ``tile_pairs`` (None elsewhere).
        self.k, self.v, self.tile_pairs = _pair(shape, store, device)
        # With int8 rows, one float32 scale per (layer, block, KV head, token).
        self.k_scale: torch.Tensor | None = None
        self.v_scale: torch.Tensor | None = None
        if quantized:
            self.k_scale, self.v_scale, _ = _pair(shape[:-1], torch.float32, device)
        # A CPU pool is not asked for 2 MiB pages (madvise). They read up to 10% faster in the
        # kernel, but a pool's pages are first touched inside decode steps (the prefix cache
        # keeps drawing fresh blocks until the whole pool has been used). On the VMs we measure
        # on, first writes to fresh memory ran at 0.3-1.1 GB/s on 2 MiB pages against 5.4 GB/s on
        # 4 KiB pages, and the offline SmolLM2 run lost 1.5 s of 8.9 s to such stalls (docs/benchmarks.md,
        # CPU-only serving).

    @property
    def quantized(self) -> bool:
        return self.k_scale is not None

    def scales(self) -> RowScales:
        """The row scales as keyword arguments of a CPU attention call (none for a float pool)."""
        if self.k_scale is None or self.v_scale is None:
            return {}
        return {"k_scale": self.k_scale, "v_scale": self.v_scale}

    def write(self, layer: int, slots: Slots, k: torch.Tensor, v: torch.Tensor) -> None:
        """Store each token's ``[kv_heads, head_dim]`` K/V at its (block, offset) slot."""
        block, offset = slots
        self._put(lambda t: t[layer], (block, slice(None), offset), k, v)

    def store_blocks(self, index: tuple, k: torch.Tensor, v: torch.Tensor) -> None:
        """Store whole blocks: ``index`` is ``(layers, block ids)`` into ``[num_layers,
        num_blocks]``; ``k``/``v`` hold their ``[kv_heads, block_size, head_dim]`` tiles."""
        self._put(lambda t: t, index, k, v)

    def load_blocks(self, block_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Every layer of blocks ``block_ids`` in the model dtype (dequantized from int8)."""
        if self.k_scale is None or self.v_scale is None:
            return self.k[:, block_ids], self.v[:, block_ids]
        out = []
        for x, s in ((self.k, self.k_scale), (self.v, self.v_scale)):
            rows = x[:, block_ids]
            out.append(torch.empty(rows.shape, dtype=self.layout.dtype))
            dequantize_rows(rows, s[:, block_ids], out[-1])
        return out[0], out[1]

    def poison_blocks(self, index: tuple) -> None:
        """What a copy in flight leaves in whole blocks (the async-copy emulation)."""
        self._poison(lambda t: t, index)

    def poison_slots(self, layer: int, slots: Slots) -> None:
        block, offset = slots
        self._poison(lambda t: t[layer], (block, slice(None), offset))

    def _put(
        self, view: Callable[[torch.Tensor], torch.Tensor], index: tuple, k: torch.Tensor, v: torch.Tensor
    ) -> None:
        if self.k_scale is None or self.v_scale is None:
            view(self.k)[index], view(self.v)[index] = k, v
            return
        for pool, scales, x in ((self.k, self.k_scale, k), (self.v, self.v_scale, v)):
            x = x.contiguous()
            q = torch.empty(x.shape, dtype=torch.int8)
            s = torch.empty(x.shape[:-1], dtype=torch.float32)
            quantize_rows(x, q, s)
            view(pool)[index], view(scales)[index] = q, s

    def _poison(self, view: Callable[[torch.Tensor], torch.Tensor], index: tuple) -> None:
        for pool, scales in ((self.k, self.k_scale), (self.v, self.v_scale)):
            view(pool)[index] = INT8_POISON if scales is not None else float("nan")
            if scales is not None:
                view(scales)[index] = float("nan")


def _pair(
    shape: tuple[int, ...], dtype: torch.dtype, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """K and V tensors of ``shape``, and the tensor they are the halves of: in CPU memory one
    ``[*shape[:3], 2, *shape[3:]]``, interleaved per (block, KV head) (the CPU kernel's layout;
    see the module docstring); elsewhere none (GPU kernels take separate contiguous pools)."""
    if device.type != "cpu":
        return (
            torch.empty(shape, dtype=dtype, device=device),
            torch.empty(shape, dtype=dtype, device=device),
            None,
        )
    both = page_aligned_empty((*shape[:3], 2, *shape[3:]), dtype)
    return both[:, :, :, 0], both[:, :, :, 1], both


def page_aligned_empty(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """An uninitialized CPU tensor whose data starts on a page boundary. A large ``torch.empty``
    starts 64 bytes into a page, so each 4 KiB tile pair of an int8 pool (block 16, head_dim 128;
    bf16's are 8 KiB) would touch one page more than it needs: one more TLB miss and one more
    hardware-prefetch stream to start per tile. Reading the tiles of a decode call out of the
    caches ran 1.02-1.12x faster aligned (``benches/attn_cpu.py`` reads its pools so too)."""
    nbytes = prod(shape) * dtype.itemsize
    raw = torch.empty(nbytes + PAGESIZE, dtype=torch.uint8)
    start = -raw.data_ptr() % PAGESIZE
    return raw[start : start + nbytes].view(dtype).view(shape)


def split_slots(slot_mapping: np.ndarray, block_size: int) -> Slots:
    """Flat slots ``block * block_size + offset`` as (block, offset) index tensors (host)."""
    flat = torch.from_numpy(np.ascontiguousarray(slot_mapping))
    return flat // block_size, flat % block_size


def block_pairs(pairs: np.ndarray, src: KvPool, dst: KvPool) -> tuple[torch.Tensor, torch.Tensor]:
    """Source and destination block indices of ``[n, 2]`` pairs, each on its pool's device."""
    idx = torch.from_numpy(np.ascontiguousarray(pairs))
    return idx[:, 0].to(src.device), idx[:, 1].to(dst.device)
