"""The KV pools as tensors: a CPU pool leaves the OS its default page size (``kv/pools.py`` says why:
a 2 MiB page faulted inside a decode step stalls it for milliseconds), starts on a page boundary,
and keeps each (block, KV head)'s K and V tiles side by side."""

from mmap import PAGESIZE
from pathlib import Path

import torch
from neo_rs.kv.groups import KvGroups
from neo_rs.kv.pools import KvLayout, KvPool, page_aligned_empty

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


def test_cpu_pool_starts_on_a_page_boundary():
    # Llama-3-8B's shapes: an int8 tile pair is exactly one 4 KiB page, a bfloat16 one two pages,
    # and a large torch.empty starts 64 bytes into a page (one page more per tile pair read).
    layout = KvLayout(num_layers=1, num_kv_heads=8, block_size=16, head_dim=128, dtype=torch.bfloat16)
    for quantized in (False, True):
        pool = KvPool(layout, num_blocks=256, device=torch.device("cpu"), quantized=quantized)
        # The scales' pairs start where K's scales do (V's are their second half).
        tensors = [pool.tile_pairs] + ([pool.k_scale] if quantized else [])
        assert all(t.data_ptr() % PAGESIZE == 0 for t in tensors)
        pair = pool.tile_pairs[0, 0, 0]
        assert pair.numel() * pair.element_size() == (4096 if quantized else 8192)


def test_page_aligned_empty_is_a_plain_contiguous_tensor():
    for dtype in (torch.int8, torch.bfloat16, torch.float32):
        t = page_aligned_empty((3, 5, 7), dtype)
        assert t.shape == (3, 5, 7) and t.dtype == dtype and t.is_contiguous()
        assert t.data_ptr() % PAGESIZE == 0
        want = torch.arange(105).view(3, 5, 7)
        t.copy_(want)
        assert torch.equal(t.long(), want)


def test_kv_groups_split_a_hybrid_models_layers_into_equal_groups() -> None:
    # Gemma 3 1B: five sliding layers, then a global one, 26 layers (22 sliding, 4 global):
    # groups of 4 layers, the last sliding group short; each group's layers take slots 0, 1, ...
    windows = [None if i % 6 == 5 else 512 for i in range(26)]
    g = KvGroups.of(windows)
    assert (g.num_groups, g.num_slots) == (7, 4)
    assert g.windows == (512, 512, None, 512, 512, 512, 512)  # in the order of their first layers
    by_group = [[i for i in range(26) if g.group[i] == n] for n in range(7)]
    assert by_group[1] == [4, 6, 7, 8] and by_group[2] == [5, 11, 17, 23] and by_group[6] == [24, 25]
    assert all([g.slot[i] for i in ls] == list(range(len(ls))) for ls in by_group)
    # A slot's copies go before its first writer and after its last.
    assert [i for i in range(26) if g.first_writer(i)] == [0, 1, 2, 3]
    assert [i for i in range(26) if g.last_writer(i)] == [21, 23, 24, 25]
    # Gemma 2: alternating, two groups of half the layers.
    alt = KvGroups.of([4096, None] * 13)
    assert (alt.windows, alt.num_slots, alt.slot[:4]) == ((4096, None), 13, (0, 0, 1, 1))
    # One kind of layer: one group of every layer, a slot each.
    for one in (KvGroups.of([None] * 3), KvGroups.of([8] * 3)):
        assert (one.num_groups, one.slot, one.group) == (1, (0, 1, 2), (0, 0, 0))
    assert KvGroups.of([8] * 3).windows == (8,)
