"""The KV pools as tensors: a CPU pool leaves the OS its default page size (``kv_cache.py`` says why:
a 2 MiB page faulted inside a decode step stalls it for milliseconds), and keeps each (block, KV
head)'s K and V tiles side by side."""

from pathlib import Path

import torch
from neo_rs.kv_cache import KvLayout, KvPool

HUGE = 2 << 20


def advised(addr: int) -> bool:
    """Whether the mapping holding ``addr`` was advised to use huge pages (``hg`` in its VmFlags)."""
    inside = False
    for line in Path("/proc/self/smaps").read_text().splitlines():
        head = line.split()[0]
        if "-" in head and all(c in "0123456789abcdef-" for c in head):
            lo, hi = (int(x, 16) for x in head.split("-"))
            inside = lo <= addr < hi
        elif inside and head == "VmFlags:":
            return "hg" in line.split()[1:]
    raise AssertionError(f"no mapping holds {addr:#x}")


def test_cpu_pool_does_not_ask_for_huge_pages():
    layout = KvLayout(num_layers=2, num_kv_heads=4, block_size=16, head_dim=64, dtype=torch.bfloat16)
    pool = KvPool(layout, num_blocks=1024, device=torch.device("cpu"))  # 16 MiB per tensor
    for t in (pool.k, pool.v):
        inside = -(-t.data_ptr() // HUGE) * HUGE  # first 2 MiB boundary inside the tensor
        assert not advised(inside) and not advised(inside + 4 * HUGE)


def test_cpu_pool_keeps_k_and_v_tiles_side_by_side():
    layout = KvLayout(num_layers=2, num_kv_heads=4, block_size=16, head_dim=64, dtype=torch.bfloat16)
    for quantized in (False, True):
        pool = KvPool(layout, num_blocks=8, device=torch.device("cpu"), quantized=quantized)
        pairs = [(pool.k, pool.v)] + ([(pool.k_scale, pool.v_scale)] if quantized else [])
        for k, v in pairs:
            tile = k[0, 0, 0]  # one (block, KV head)'s rows
            assert v.data_ptr() == k.data_ptr() + tile.numel() * tile.element_size()
            assert k.stride(2) == 2 * tile.numel() and v.stride() == k.stride()
        # Writes through the halves land where the kernel reads them.
        pool.k.fill_(1)
        pool.v.fill_(2)
        assert (pool.k == 1).all() and (pool.v == 2).all()
