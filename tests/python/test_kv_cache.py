"""The KV pools as tensors: a CPU pool is backed by 2 MiB pages where the OS allows it."""

from pathlib import Path

import torch
from neo_rs._core import advise_huge_pages
from neo_rs.kv_cache import KvLayout, KvPool

HUGE = 2 << 20


def huge_kib(addr: int, size: int) -> int:
    """AnonHugePages of every mapping overlapping ``[addr, addr + size)``, in KiB."""
    total, inside = 0, False
    for line in Path("/proc/self/smaps").read_text().splitlines():
        head = line.split()[0]
        if "-" in head and all(c in "0123456789abcdef-" for c in head):
            lo, hi = (int(x, 16) for x in head.split("-"))
            inside = lo < addr + size and addr < hi
        elif inside and head == "AnonHugePages:":
            total += int(line.split()[1])
    return total


def thp_mode() -> str:
    text = Path("/sys/kernel/mm/transparent_hugepage/enabled").read_text()
    return text[text.index("[") + 1 : text.index("]")]


def test_advice_covers_the_aligned_interior():
    t = torch.empty(5 * HUGE // 4, dtype=torch.float32)
    start, end = t.data_ptr(), t.data_ptr() + t.numel() * 4
    interior = end // HUGE * HUGE - -(-start // HUGE) * HUGE
    assert advise_huge_pages(t) == interior
    assert advise_huge_pages(torch.empty(1024, dtype=torch.float32)) == 0  # smaller than a page


def test_cpu_pool_gets_huge_pages():
    layout = KvLayout(num_layers=2, num_kv_heads=4, block_size=16, head_dim=64, dtype=torch.bfloat16)
    pool = KvPool(layout, num_blocks=1024, device=torch.device("cpu"))  # 16 MiB per tensor
    pool.k.fill_(1.0)  # first touch, after the advice
    size = pool.k.numel() * pool.k.element_size()
    if thp_mode() in ("always", "madvise"):
        assert huge_kib(pool.k.data_ptr(), size) >= (size - 2 * HUGE) // 1024 // 2
