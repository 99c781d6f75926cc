"""Our Triton paged prefill kernel (later prefill chunks on CUDA: chunked prefills, prompts after a
cached prefix), executed on the CPU by Triton's interpreter, against SDPA over the whole sequence
in float64: GQA groups, block sizes below and above the kernel's token tile, head dims that are not
powers of two, chunks of one row to several row tiles, from position 0 or after a prefix, every
pool slot past the sequence poisoned."""

from __future__ import annotations

import os

import pytest
import torch
import torch.nn.functional as F

_was = os.environ.get("TRITON_INTERPRET")
os.environ["TRITON_INTERPRET"] = "1"  # as in test_triton_decode.py: read when the kernel is made
from neo_rs import CpuAttention  # noqa: E402
from neo_rs.attention import Attention, Prefill  # noqa: E402
from neo_rs.cuda.paged_prefill import paged_prefill  # noqa: E402
from neo_rs.device_decode import select_paged_prefill  # noqa: E402
from neo_rs.kv_cache import KvLayout, KvPool  # noqa: E402
from neo_rs.transfer import HostTransfer  # noqa: E402

if _was is None:
    del os.environ["TRITON_INTERPRET"]


@pytest.fixture(autouse=True)
def _interpret(monkeypatch: pytest.MonkeyPatch) -> None:
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
    got = paged_prefill(q, k_cache, v_cache, table, computed, seq_len, scale)
    rows = torch.arange(computed, seq_len)[:, None]
    mask = torch.arange(seq_len)[None, :] <= rows
    want = F.scaled_dot_product_attention(
        q.double().transpose(0, 1), k_seq.double().transpose(0, 1), v_seq.double().transpose(0, 1),
        attn_mask=mask, scale=scale, enable_gqa=True,
    ).transpose(0, 1)  # fmt: skip
    assert got.dtype == dtype and got.shape == q.shape
    torch.testing.assert_close(got.double(), want, atol=TOL[dtype], rtol=TOL[dtype])


def test_attention_hands_later_chunks_to_the_kernel_as_it_would_on_cuda() -> None:
    # A CPU runner gathers the context; with the kernel put in (as a CUDA runner selects it),
    # the same chunk gives the same rows: the call's arguments are the kernel's.
    layout = KvLayout(num_layers=2, num_kv_heads=2, block_size=16, head_dim=32, dtype=torch.float32)
    pool = KvPool(layout, 8, torch.device("cpu"))
    pool.k.normal_(), pool.v.normal_()
    attn = Attention(32**-0.5, CpuAttention(), HostTransfer(torch.device("cpu")))
    assert attn.paged_prefill is None
    q, k, v = (torch.randn(20, n, 32) for n in (8, 2, 2))
    chunk = Prefill(0, 20, 30, 50, torch.tensor([5, 2, 7, 0]))
    gathered = attn.prefill(q, k, v, pool, 1, chunk)
    attn.paged_prefill = paged_prefill
    torch.testing.assert_close(attn.prefill(q, k, v, pool, 1, chunk), gathered, atol=1e-5, rtol=1e-5)


def test_neo_rs_device_attention_torch_keeps_the_gather(monkeypatch: pytest.MonkeyPatch) -> None:
    assert select_paged_prefill() is paged_prefill
    monkeypatch.setenv("NEO_RS_DEVICE_ATTENTION", "torch")
    assert select_paged_prefill() is None
