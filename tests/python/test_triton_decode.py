"""Our Triton paged decode kernel (what device decodes run on CUDA), compiled on a CUDA host and
otherwise executed on the CPU by Triton's interpreter, against the Rust kernel on random shapes:
GQA groups (powers of two and not), ragged last blocks, empty, one-token and 8k-token sequences
(split into pieces), bf16, fp16 and fp32, with every pool slot past a sequence's length poisoned."""

from __future__ import annotations

import pytest
import torch
from decode_cases import CASES, INTERPRET, KERNEL_DEVICE, KIND_CASES, TOL, interpret_imports, make_case
from neo_rs import CpuAttention

with interpret_imports():
    from neo_rs.attention.cuda.paged_decode import SplitPlan, paged_decode


@pytest.fixture(autouse=True)
def _interpret(monkeypatch: pytest.MonkeyPatch) -> None:
    if INTERPRET:
        monkeypatch.setenv("TRITON_INTERPRET", "1")


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32], ids=str)
@pytest.mark.parametrize("case", range(len(CASES)))
def test_triton_decode_matches_the_rust_kernel(case: int, dtype: torch.dtype) -> None:
    lens, kv_heads, group, head_dim, block_size = CASES[case]
    q, k, v, tables, seq_lens = make_case(lens, kv_heads, group, head_dim, block_size, dtype, seed=case)
    scale = head_dim**-0.5
    want = torch.empty_like(q)
    CpuAttention().forward(q, k, v, 1, tables, seq_lens, scale, want)
    plan = SplitPlan.for_lengths(max(lens), block_size)
    q, k, v, tables, seq_lens = (t.to(KERNEL_DEVICE) for t in (q, k, v, tables, seq_lens))
    got = torch.full_like(q, float("nan"))
    paged_decode(q, k[1], v[1], tables, seq_lens, scale, got, plan.num_splits, plan.blocks_per_split)
    torch.testing.assert_close(got.cpu().float(), want.float(), atol=TOL[dtype], rtol=TOL[dtype])
    if max(lens) == 8192:
        assert plan.num_splits > 1, plan


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=str)
@pytest.mark.parametrize(("case", "window", "softcap"), KIND_CASES)
def test_windows_and_caps_match_the_rust_kernel(
    case: int, window: int | None, softcap: float | None, dtype: torch.dtype
) -> None:
    lens, kv_heads, group, head_dim, block_size = CASES[case]
    q, k, v, tables, seq_lens = make_case(lens, kv_heads, group, head_dim, block_size, dtype, seed=case)
    scale = head_dim**-0.5
    want = torch.empty_like(q)
    CpuAttention().forward(q, k, v, 1, tables, seq_lens, scale, want, window=window, softcap=softcap)
    plan = SplitPlan.for_lengths(max(lens), block_size)
    q, k, v, tables, seq_lens = (t.to(KERNEL_DEVICE) for t in (q, k, v, tables, seq_lens))
    got = torch.full_like(q, float("nan"))
    paged_decode(
        q,
        k[1],
        v[1],
        tables,
        seq_lens,
        scale,
        got,
        plan.num_splits,
        plan.blocks_per_split,
        window or 0,
        softcap or 0.0,
    )
    torch.testing.assert_close(got.cpu().float(), want.float(), atol=TOL[dtype], rtol=TOL[dtype])


def test_split_plan() -> None:
    assert SplitPlan.for_lengths(0, 16) == SplitPlan(1, 1)
    assert SplitPlan.for_lengths(512, 16).num_splits == 1
    long = SplitPlan.for_lengths(8192, 16)
    assert long.num_splits * long.blocks_per_split >= 8192 // 16 and long.num_splits <= 16
