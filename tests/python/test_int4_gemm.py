"""The Triton int4 weight-only GEMM (``Int4Linear`` on GPUs tinygemm does not run on), compiled on
a CUDA host and otherwise run by Triton's interpreter, against the dequantized weight's product
in float64: groups of 32, 64 and 128, float32, float16 and bfloat16, batches of 1 to 33 rows
and output widths that are no multiple of its tiles."""

from __future__ import annotations

import pytest
import torch
from decode_cases import INTERPRET, KERNEL_DEVICE, interpret_imports
from neo_rs.model.quant import Int4Blocks, quantize_int4

with interpret_imports():
    from neo_rs.model.cuda.int4_gemm import int4_gemm, pack_for_triton


@pytest.fixture(autouse=True)
def _interpret(monkeypatch: pytest.MonkeyPatch) -> None:
    if INTERPRET:
        monkeypatch.setenv("TRITON_INTERPRET", "1")


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16], ids=str)
@pytest.mark.parametrize(
    ("rows", "out_features", "in_features", "group"), [(1, 48, 64, 32), (5, 80, 128, 64), (33, 16, 256, 128)]
)
def test_int4_gemm_multiplies_by_the_dequantized_weight(
    dtype: torch.dtype, rows: int, out_features: int, in_features: int, group: int
) -> None:
    torch.manual_seed(0)
    q, scale, zero = quantize_int4(torch.randn(out_features, in_features), group)
    blocks = Int4Blocks(q.to(torch.uint8), scale.to(dtype).float(), zero.to(dtype).float())
    sz = torch.stack([scale, zero], dim=-1).transpose(0, 1).contiguous().to(dtype)
    x = torch.randn(rows, in_features).to(dtype)
    got = int4_gemm(x.to(KERNEL_DEVICE), pack_for_triton(q).to(KERNEL_DEVICE), sz.to(KERNEL_DEVICE), group)
    assert got.dtype == dtype and got.shape == (rows, out_features)
    want = x.double() @ blocks.dequantized().double().t()
    tol = {torch.float32: 1e-4, torch.float16: 2e-2, torch.bfloat16: 5e-2}[dtype]
    torch.testing.assert_close(got.cpu().double(), want, rtol=tol, atol=tol * want.abs().max().item())
