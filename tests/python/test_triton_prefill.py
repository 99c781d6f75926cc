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
from decode_cases import INTERPRET, KERNEL_DEVICE, interpret_imports, reference_attention
from neo_rs import CpuAttention
from neo_rs.attention.device_decode import select_paged_prefill
from neo_rs.attention.layer import Attention, attend_positions
from neo_rs.attention.metadata import Prefill
from neo_rs.config import AttentionKind
from neo_rs.kv.groups import KvGroups
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


def _sequence_in_pool(case: int, dtype: torch.dtype) -> tuple[torch.Tensor, ...]:
    """Case ``case``'s K/V, its chunk's q, and the K/V in a shuffled, poisoned pool."""
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
    return k_seq, v_seq, q, k_cache, v_cache, table


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32], ids=str)
@pytest.mark.parametrize("case", range(len(CASES)))
def test_paged_prefill_matches_sdpa_over_the_whole_sequence(case: int, dtype: torch.dtype) -> None:
    seq_len, computed, _, _, head_dim, _ = CASES[case]
    k_seq, v_seq, q, k_cache, v_cache, table = _sequence_in_pool(case, dtype)
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


# (case, window, softcap): windows inside one row tile, across tiles and blocks, past the start.
KINDS = [(0, 25, None), (1, 3, 4.0), (2, 9, None), (3, None, 2.0), (4, 70, 1.0)]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=str)
@pytest.mark.parametrize(("case", "window", "softcap"), KINDS)
def test_windows_and_caps_in_every_prefill_path(
    case: int, window: int | None, softcap: float | None, dtype: torch.dtype
) -> None:
    """The kernel, the gather of a later chunk and a first chunk's own K/V, each against the
    float64 reference of the same rows."""
    seq_len, computed, kv_heads, _, head_dim, bs = CASES[case]
    k_seq, v_seq, q, k_cache, v_cache, table = _sequence_in_pool(case, dtype)
    kind = AttentionKind(head_dim**-0.5, window, softcap)
    want = reference_attention(q, k_seq, v_seq, computed, kind.scale, window, softcap)
    on = KERNEL_DEVICE
    kv = k_cache.to(on), v_cache.to(on)
    got = paged_prefill(
        q.to(on), *kv, table.to(on), computed, seq_len, kind.scale, window or 0, softcap or 0.0
    )
    tol = dict(atol=TOL[dtype], rtol=TOL[dtype])
    torch.testing.assert_close(got.cpu().double(), want, **tol)
    layout = KvLayout(num_layers=1, num_kv_heads=kv_heads, block_size=bs, head_dim=head_dim, dtype=dtype)
    pool = KvPool(layout, k_cache.shape[0], torch.device("cpu"))
    pool.k[0], pool.v[0] = k_cache, v_cache
    attn = Attention([kind], CpuAttention(), HostTransfer(torch.device("cpu")), KvGroups.of([kind.window]))
    chunk = Prefill(0, len(q), computed, seq_len, table)
    own = k_seq[computed:], v_seq[computed:]  # the chunk's K/V (a first chunk reads only these)
    torch.testing.assert_close(attn.prefill(q, *own, pool, 0, chunk).double(), want, **tol)
    if window is not None:
        # Blocks wholly before the first row's window may have been released (their entries
        # read block 0, whatever it holds): poisoned, neither path reads them.
        behind = table[: max(computed + 1 - window, 0) // bs].long()
        for c in (k_cache, v_cache, pool.k[0], pool.v[0]):
            c[behind] = float("nan")
        kv = k_cache.to(on), v_cache.to(on)
        got = paged_prefill(
            q.to(on), *kv, table.to(on), computed, seq_len, kind.scale, window, softcap or 0.0
        )
        torch.testing.assert_close(got.cpu().double(), want, **tol)
        torch.testing.assert_close(attn.prefill(q, *own, pool, 0, chunk).double(), want, **tol)
    whole = reference_attention(k_seq.repeat_interleave(2, 1), k_seq, v_seq, 0, kind.scale, window, softcap)
    first = attend_positions(k_seq.repeat_interleave(2, 1), k_seq, v_seq, 0, kind)
    torch.testing.assert_close(first.double(), whole, **tol)


def test_attention_hands_later_chunks_to_the_kernel_as_it_would_on_cuda() -> None:
    # Without the kernel (a CPU runner) the context is gathered; with it put in (as a CUDA runner
    # selects it), the same chunk gives the same rows: the call's arguments are the kernel's.
    on = KERNEL_DEVICE
    layout = KvLayout(num_layers=2, num_kv_heads=2, block_size=16, head_dim=32, dtype=torch.float32)
    pool = KvPool(layout, 8, on)
    pool.k.normal_(), pool.v.normal_()
    attn = Attention([AttentionKind(32**-0.5)] * 2, CpuAttention(), HostTransfer(on), KvGroups.of([None] * 2))
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
