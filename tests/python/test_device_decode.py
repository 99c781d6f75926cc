"""The CUDA backends of device decodes that CI can check on the CPU, against the Rust kernel on the
shared random cases: the torch fallback itself, and FlashInfer's adapter through a pure-torch
reference of FlashInfer's paged-KV contract, fed the exact arguments the adapter passes (a stand-in
``flashinfer`` module records them). Also: each backend plans once per iteration's rows, and
``NEO_RS_DEVICE_ATTENTION`` picks them."""

from __future__ import annotations

import sys
import types
from dataclasses import replace

import pytest
import torch
from decode_cases import CASES, KIND_CASES, TOL, make_case
from neo_rs import CpuAttention, InvalidArgumentError
from neo_rs.attention.cuda.flashinfer_decode import FlashInferDecode, paged_kv_args
from neo_rs.attention.device_decode import (
    TokenIndex,
    TorchDecode,
    TritonDecode,
    paged_decode_torch,
    select_device_decode,
)
from neo_rs.attention.metadata import DecodeRows
from neo_rs.config import AttentionKind
from neo_rs.kv.pools import KvLayout, KvPool

DTYPES = [torch.bfloat16, torch.float16, torch.float32]


def flashinfer_reference(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    indptr: torch.Tensor,
    indices: torch.Tensor,
    last_page_len: torch.Tensor,
    sm_scale: float,
    window_left: int = -1,
    logits_soft_cap: float | None = None,
) -> torch.Tensor:
    """FlashInfer's batch decode as its documentation defines it, for HND caches ``[pages,
    kv_heads, page_size, head_dim]``: request ``b`` attends over its pages ``indices[indptr[b]:
    indptr[b + 1]]`` in order, all of each but the last, of which the first ``last_page_len[b]``
    tokens; with ``window_left`` >= 0 only the last ``window_left + 1`` of those, and with
    ``logits_soft_cap`` the scaled scores capped by ``cap · tanh(s / cap)``. (An empty request
    gives zeros, as our kernels do.)"""
    out = torch.zeros(q.shape, dtype=torch.float64)
    page_size = k_cache.shape[2]
    for b in range(len(last_page_len)):
        pages = indices[int(indptr[b]) : int(indptr[b + 1])].long()
        if len(pages) == 0:
            continue
        n = (len(pages) - 1) * page_size + int(last_page_len[b])
        k = k_cache[pages].transpose(0, 1).reshape(k_cache.shape[1], -1, k_cache.shape[3])[:, :n].double()
        v = v_cache[pages].transpose(0, 1).reshape(v_cache.shape[1], -1, v_cache.shape[3])[:, :n].double()
        group = q.shape[1] // k_cache.shape[1]
        k, v = k.repeat_interleave(group, 0), v.repeat_interleave(group, 0)
        s = torch.einsum("hd,hnd->hn", q[b].double(), k) * sm_scale
        if logits_soft_cap:
            s = logits_soft_cap * torch.tanh(s / logits_soft_cap)
        if window_left >= 0:  # masked, not sliced off: like a kernel, it reads every page given
            s[:, : max(n - window_left - 1, 0)] = float("-inf")
        out[b] = torch.einsum("hn,hnd->hd", torch.softmax(s, dim=-1), v)
    return out


class _Wrapper:
    """Stand-in for ``flashinfer.BatchDecodeWithPagedKVCacheWrapper``: checks the adapter's calls
    against FlashInfer's documented signature and runs the reference on what ``plan`` got."""

    plans = 0

    def __init__(self, workspace: torch.Tensor, kv_layout: str) -> None:
        assert kv_layout == "HND" and workspace.dtype == torch.uint8

    def plan(
        self,
        indptr: torch.Tensor,
        indices: torch.Tensor,
        last_page_len: torch.Tensor,
        num_qo_heads: int,
        num_kv_heads: int,
        head_dim: int,
        page_size: int,
        **kw: object,
    ) -> None:
        for t in (indptr, indices, last_page_len):  # host int32: planning never waits on the device
            assert t.dtype == torch.int32 and t.device.type == "cpu"
        assert kw["pos_encoding_mode"] == "NONE" and kw["q_data_type"] == kw["kv_data_type"]
        self.args = indptr, indices, last_page_len, kw["sm_scale"], kw["window_left"], kw["logits_soft_cap"]
        self.shape = num_qo_heads, num_kv_heads, head_dim, page_size
        _Wrapper.plans += 1

    def run(
        self, q: torch.Tensor, paged_kv_cache: tuple[torch.Tensor, torch.Tensor], *, out: torch.Tensor
    ) -> None:
        k, v = paged_kv_cache
        assert self.shape == (q.shape[1], k.shape[1], k.shape[3], k.shape[2])
        out.copy_(flashinfer_reference(q, k, v, *self.args))


@pytest.fixture
def fake_flashinfer(monkeypatch: pytest.MonkeyPatch) -> None:
    module = types.ModuleType("flashinfer")
    module.BatchDecodeWithPagedKVCacheWrapper = _Wrapper  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "flashinfer", module)


def _pool_and_rows(
    case: int, dtype: torch.dtype, window: int | None = None, softcap: float | None = None
) -> tuple[torch.Tensor, KvPool, DecodeRows, torch.Tensor]:
    """Case ``case``'s q, its K/V as a pool, its rows, and the Rust kernel's output on layer 1."""
    lens, kv_heads, group, head_dim, block_size = CASES[case]
    q, k, v, tables, seq_lens = make_case(lens, kv_heads, group, head_dim, block_size, dtype, seed=case)
    want = torch.empty_like(q)
    CpuAttention().forward(q, k, v, 1, tables, seq_lens, head_dim**-0.5, want, window=window, softcap=softcap)
    pool = KvPool(KvLayout(2, kv_heads, block_size, head_dim, dtype), k.shape[1], torch.device("cpu"))
    pool.k, pool.v = k, v
    rows = DecodeRows(0, len(lens), tables, seq_lens, max(lens), tables, seq_lens)
    return q, pool, rows, want


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("case", range(len(CASES)))
def test_the_torch_fallback_matches_the_rust_kernel(case: int, dtype: torch.dtype) -> None:
    q, pool, rows, want = _pool_and_rows(case, dtype)
    index = TokenIndex.of(rows.block_tables, rows.seq_lens, pool.layout.block_size, rows.max_seq_len, None)
    got = paged_decode_torch(q, pool, 1, index, AttentionKind(pool.layout.head_dim**-0.5))
    torch.testing.assert_close(got.float(), want.float(), atol=TOL[dtype], rtol=TOL[dtype])


@pytest.mark.parametrize("backend", ["torch", "flashinfer"])
@pytest.mark.parametrize(("case", "window", "softcap"), KIND_CASES)
def test_windows_and_caps_match_the_rust_kernel(
    case: int, window: int | None, softcap: float | None, backend: str, fake_flashinfer: None
) -> None:
    dtype = torch.float32
    q, pool, rows, want = _pool_and_rows(case, dtype, window, softcap)
    decode = TorchDecode() if backend == "torch" else FlashInferDecode(torch.device("cpu"))
    got = torch.full_like(q, float("nan"))
    decode(q, pool, 1, rows, AttentionKind(pool.layout.head_dim**-0.5, window, softcap), got)
    torch.testing.assert_close(got, want, atol=TOL[dtype], rtol=TOL[dtype])


@pytest.mark.parametrize("backend", ["rust", "torch", "flashinfer"])
@pytest.mark.parametrize(("case", "window", "softcap"), [c for c in KIND_CASES if c[1] is not None])
def test_blocks_behind_the_window_are_never_read(
    case: int, window: int, softcap: float | None, backend: str, fake_flashinfer: None
) -> None:
    # Under a window on every layer the scheduler releases the blocks wholly before it (their
    # table entries read block 0 then, whatever it holds): poisoned here, no path may read them.
    q, pool, rows, want = _pool_and_rows(case, torch.float32, window, softcap)
    bs = pool.layout.block_size
    for i, n in enumerate(rows.seq_lens.tolist()):
        behind = rows.block_tables[i, : max(n - window, 0) // bs].long()
        pool.k[1][behind], pool.v[1][behind] = float("nan"), float("nan")
    kind = AttentionKind(pool.layout.head_dim**-0.5, window, softcap)
    got = torch.full_like(q, float("nan"))
    if backend == "rust":
        CpuAttention().forward(
            q,
            pool.k,
            pool.v,
            1,
            rows.block_tables,
            rows.seq_lens,
            kind.scale,
            got,
            window=window,
            softcap=softcap,
        )
    else:
        decode = TorchDecode() if backend == "torch" else FlashInferDecode(torch.device("cpu"))
        decode(q, pool, 1, rows, kind, got)
    torch.testing.assert_close(got, want, atol=TOL[torch.float32], rtol=TOL[torch.float32])


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("case", range(len(CASES)))
def test_flashinfer_gets_our_page_table_in_its_form(
    case: int, dtype: torch.dtype, fake_flashinfer: None
) -> None:
    q, pool, rows, want = _pool_and_rows(case, dtype)
    got = torch.full_like(q, float("nan"))
    FlashInferDecode(torch.device("cpu"))(q, pool, 1, rows, AttentionKind(pool.layout.head_dim**-0.5), got)
    torch.testing.assert_close(got.float(), want.float(), atol=TOL[dtype], rtol=TOL[dtype])


def test_paged_kv_args() -> None:
    tables = torch.tensor([[7, 3, 9], [4, 0, 0], [5, 6, 0], [0, 0, 0]], dtype=torch.int32)
    indptr, indices, last = paged_kv_args(tables, torch.tensor([33, 16, 17, 0], dtype=torch.int32), 16)
    assert indptr.tolist() == [0, 3, 4, 6, 6]
    assert indices.tolist() == [7, 3, 9, 4, 5, 6]
    assert last.tolist() == [1, 16, 1, 0]


@pytest.mark.parametrize("backend", ["torch", "flashinfer"])
def test_backends_plan_once_per_iterations_rows(
    backend: str, fake_flashinfer: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    q, pool, rows, _ = _pool_and_rows(0, torch.float32)
    calls = []
    if backend == "torch":
        decode, of = TorchDecode(), TokenIndex.of
        monkeypatch.setattr(TokenIndex, "of", staticmethod(lambda *a: calls.append(1) or of(*a)))
    else:
        decode, _Wrapper.plans = FlashInferDecode(torch.device("cpu")), 0
    out = torch.empty_like(q)
    kind = AttentionKind(0.125)
    # A hybrid model's layers alternate KV groups, each with rows (tables) of its own: a plan
    # each, kept while the layers alternate.
    other = replace(rows, group=1)
    for layer, r in ((0, rows), (1, other), (0, rows), (1, other)):
        decode(q, pool, layer, r, kind, out)
    again = DecodeRows(**vars(rows))  # the next iteration's rows, equal but new
    decode(q, pool, 1, again, kind, out)
    assert (len(calls) if backend == "torch" else _Wrapper.plans) == 3


def test_flashinfer_plans_each_attention_kind_apart(fake_flashinfer: None) -> None:
    # Gemma's sliding and global layers alternate within one iteration: each kind keeps its own
    # planned wrapper, so neither re-plans the other's window away (one plan per kind and rows).
    q, pool, rows, _ = _pool_and_rows(0, torch.float32)
    scale = pool.layout.head_dim**-0.5
    sliding, full = AttentionKind(scale, 7), AttentionKind(scale)
    want = {}
    for kind in (sliding, full):
        want[kind] = torch.empty_like(q)
        TorchDecode()(q, pool, 1, rows, kind, want[kind])
    decode, _Wrapper.plans = FlashInferDecode(torch.device("cpu")), 0
    for kind in (sliding, full, sliding, full):
        got = torch.full_like(q, float("nan"))
        decode(q, pool, 1, rows, kind, got)
        torch.testing.assert_close(got, want[kind], atol=1e-5, rtol=1e-5)
    assert _Wrapper.plans == 2


def test_neo_rs_device_attention_picks_the_backend(monkeypatch: pytest.MonkeyPatch) -> None:
    cuda = torch.device("cuda")
    monkeypatch.setitem(sys.modules, "flashinfer", None)  # not installed: its import fails
    for name, kind in [("torch", TorchDecode), ("triton", TritonDecode), ("auto", TritonDecode)]:
        monkeypatch.setenv("NEO_RS_DEVICE_ATTENTION", name)
        assert isinstance(select_device_decode(cuda), kind), name
    for name in ("flashinfer", "cudnn"):
        monkeypatch.setenv("NEO_RS_DEVICE_ATTENTION", name)
        with pytest.raises(InvalidArgumentError, match="NEO_RS_DEVICE_ATTENTION"):
            select_device_decode(cuda)
    module = types.ModuleType("flashinfer")
    module.BatchDecodeWithPagedKVCacheWrapper = _Wrapper  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "flashinfer", module)
    monkeypatch.setenv("NEO_RS_DEVICE_ATTENTION", "auto")
    # (Its workspace on the CPU: there is no CUDA device here.)
    assert isinstance(select_device_decode(torch.device("cpu")), FlashInferDecode)
