"""The Triton fused MoE (CUDA's expert GEMMs), compiled on a CUDA host and otherwise run by Triton's
interpreter, against the CPU path's per-expert GEMMs in float64: top-k 1 and 2, experts no token
chose, one token to several tiles per expert, intermediate sizes that are not tile multiples; and
the alignment that feeds it: every pair once, grouped by expert, each run padded to whole tiles."""

from __future__ import annotations

import pytest
import torch
from decode_cases import INTERPRET, KERNEL_DEVICE, interpret_imports
from neo_rs.config import MoeConfig
from neo_rs.model.moe import SparseMoe
from neo_rs.parallel.group import SINGLE_PROCESS

with interpret_imports():
    from neo_rs.model.cuda.fused_moe import BLOCK_M, align, fused_moe


@pytest.fixture(autouse=True)
def _interpret(monkeypatch: pytest.MonkeyPatch) -> None:
    if INTERPRET:
        monkeypatch.setenv("TRITON_INTERPRET", "1")


def test_align_groups_every_pair_once_in_whole_tiles() -> None:
    torch.manual_seed(0)
    experts = 6
    chosen = torch.randint(0, experts - 1, (45,))  # the last expert is never chosen
    sorted_ids, tile_experts = align(chosen, experts)
    assert sorted_ids.numel() % BLOCK_M == 0 and sorted_ids.numel() == tile_experts.numel() * BLOCK_M
    real = sorted_ids[sorted_ids < len(chosen)]
    assert sorted(real.tolist()) == list(range(len(chosen)))  # every pair exactly once
    for t, e in enumerate(tile_experts.tolist()):
        ids = sorted_ids[t * BLOCK_M : (t + 1) * BLOCK_M]
        ids = ids[ids < len(chosen)]
        if e < 0:  # surplus tiles hold padding only
            assert ids.numel() == 0
        else:
            assert ids.numel() > 0 and (chosen[ids.long()] == e).all()
    used = tile_experts[tile_experts >= 0].tolist()
    assert used == sorted(used) and experts - 1 not in used


def _moe(hidden: int, size: int, experts: int, top_k: int, dtype: torch.dtype) -> SparseMoe:
    moe = SparseMoe(hidden, MoeConfig(experts, top_k, size, True, (True,)), SINGLE_PROCESS)
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for p in moe.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * 0.2)
    return moe.to(dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(
    ("tokens", "experts", "top_k", "size"), [(1, 4, 2, 48), (37, 8, 2, 40), (20, 5, 1, 64)]
)
def test_fused_moe_matches_the_grouped_gemms(
    tokens: int, experts: int, top_k: int, size: int, dtype: torch.dtype
) -> None:
    hidden = 32
    moe = _moe(hidden, size, experts, top_k, dtype)
    x = (torch.randn(tokens, hidden, generator=torch.Generator().manual_seed(2))).to(dtype)
    with torch.no_grad():
        chosen, weights = moe.route(x)
        want = moe.double()._grouped(x.double(), chosen, weights.double()).float()
        moe.to(dtype)
        dev = KERNEL_DEVICE
        got = fused_moe(x.to(dev), moe.w_gate_up.to(dev), moe.w_down.to(dev), chosen.to(dev), weights.to(dev))
    assert got.dtype == dtype
    tol = 1e-4 if dtype == torch.float32 else 3e-2
    torch.testing.assert_close(got.float().cpu(), want, atol=tol, rtol=tol)
