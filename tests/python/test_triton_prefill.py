"""Our Triton paged prefill kernel (later prefill chunks on CUDA: chunked prefills, prompts after a
cached prefix), compiled on a CUDA host and otherwise executed on the CPU by Triton's interpreter,
against SDPA over the whole sequence
in float64: GQA groups, block sizes below and above the kernel's token tile, head dims that are not
powers of two, chunks of one row to several row tiles, from position 0 or after a prefix, every
pool slot past the sequence poisoned."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from decode_cases import INTERPRET, KERNEL_DEVICE, interpret_imports
from neo_rs import CpuAttention
from neo_rs.attention.device_decode import select_paged_prefill
from neo_rs.attention.layer import Attention
from neo_rs.attention.metadata import Prefill
from neo_rs.kv.pools import KvLayout, KvPool
from neo_rs.kv.transfer import HostTransfer

with interpret_imports():
    from neo_rs.attention.cuda.paged_prefill import paged_prefill


@pytest.fixture(autouse=True)
def _interpret(monkeypatch: pytest.MonkeyPatch) -> None:
    if INTERPRET:
        monkeypatch.setenv("TRITON_INTERPRET", "1")


TOL = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 2e-2}
CASES = [
    # seq_len, num_computed, kv_heads, group, head_dim, block_size
    (300, 260, 2, 4, 64, 16),
    (57, 17, 3, 3, 80, 8),
    (40, 0, 1, 8, 32, 32),
    (129, 128, 4, 1, 128, 16),
    (70, 33, 2, 2, 64, 16),
]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32], ids=str)
@pytest.mark.parametrize("case", range(len(CASES)))
def test_paged_prefill_matches_sdpa_over_the_whole_sequence(case: int, dtype: torch.dtype) -> None:
    seq_len, computed, kv_heads, group, head_dim, bs = CASES[case]
    g = torch.Generator().manual_seed(case)
    k_seq = torch.randn(seq_len, kv_heads, head_dim, generator=g).to(dtype)
    v_seq = torch.randn(seq_len, kv_heads, head_dim, generator=g).to(dtype)
    q = torch.randn(seq_len - computed, kv_heads * group, head_dim, generator=g).to(dtype)
    nb = -(-seq_len // bs)
    table = torch.randperm(nb + 3, generator=g)[:nb]
    k_cache = torch.full((nb + 3, kv_heads, bs, head_dim), float("nan"), dtype=dtype)
    v_cache = torch.full_like(k_cache, float("inf"))  # never-cleared pool memory past the length
    for pos in range(seq_len):
        k_cache[table[pos // bs], :, pos % bs] = k_seq[pos]
        v_cache[table[pos // bs], :, pos % bs] = v_seq[pos]
    scale = head_dim**-0.5
    on = KERNEL_DEVICE
    kv = k_cache.to(on), v_cache.to(on)
    got = paged_prefill(q.to(on), *kv, table.to(on), computed, seq_len, scale).cpu()
    rows = torch.arange(computed, seq_len)[:, None]
    mask = torch.arange(seq_len)[None, :] <= rows
    want = F.scaled_dot_product_attention(
        q.double().transpose(0, 1), k_seq.double().transpose(0, 1), v_seq.double().transpose(0, 1),
        attn_mask=mask, scale=scale, enable_gqa=True,
    ).transpose(0, 1)  # fmt: skip
    assert got.dtype == dtype and got.shape == q.shape
    torch.testing.assert_close(got.double(), want, atol=TOL[dtype], rtol=TOL[dtype])


def test_attention_hands_later_chunks_to_the_kernel_as_it_would_on_cuda() -> None:
    # Without the kernel (a CPU runner) the context is gathered; with it put in (as a CUDA runner
    # selects it), the same chunk gives the same rows: the call's arguments are the kernel's.
    on = KERNEL_DEVICE
    layout = KvLayout(num_layers=2, num_kv_heads=2, block_size=16, head_dim=32, dtype=torch.float32)
    pool = KvPool(layout, 8, on)
    pool.k.normal_(), pool.v.normal_()
    attn = Attention(32**-0.5, CpuAttention(), HostTransfer(on))
    assert attn.paged_prefill is (paged_prefill if on.type == "cuda" else None)
    attn.paged_prefill = None
    q, k, v = (torch.randn(20, n, 32, device=on) for n in (8, 2, 2))
    chunk = Prefill(0, 20, 30, 50, torch.tensor([5, 2, 7, 0], device=on))
    gathered = attn.prefill(q, k, v, pool, 1, chunk)
    attn.paged_prefill = paged_prefill
    torch.testing.assert_close(attn.prefill(q, k, v, pool, 1, chunk), gathered, atol=1e-5, rtol=1e-5)


def test_neo_rs_device_attention_torch_keeps_the_gather(monkeypatch: pytest.MonkeyPatch) -> None:
    assert select_paged_prefill() is paged_prefill
    monkeypatch.setenv("NEO_RS_DEVICE_ATTENTION", "torch")
    assert select_paged_prefill() is None
