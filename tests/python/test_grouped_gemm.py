"""The Triton weight-only GEMMs: the grouped one (``Int4Linear`` on GPUs tinygemm does not run
on, ``GroupedInt8Linear`` on every GPU) and the FP8 one (``Fp8Linear`` where ``_scaled_mm`` does
not run), compiled on a CUDA host and otherwise run by Triton's
interpreter, against the dequantized weight's product in float64: 4 bits in groups of 32, 64 and
128, 8 bits in a GGUF's groups of 16 and 32, 8-bit GPTQ's of 128 and one of 48; float32,
float16 and bfloat16; batches of 1 to 33 rows, output widths that are no multiple of its tiles and
input widths that are no multiple of its tile of columns; FP8 with a scale per row or per row and
group of columns (block-wise checkpoints), a short last group included."""

from __future__ import annotations

import pytest
import torch
from decode_cases import INTERPRET, KERNEL_DEVICE, interpret_imports
from neo_rs.model.fp8 import FP8
from neo_rs.model.quant import Int4Blocks, Int8Blocks, quantize_int4

with interpret_imports():
    from neo_rs.model.cuda.fp8_gemm import fp8_gemm
    from neo_rs.model.cuda.grouped_gemm import grouped_gemm, pack_for_triton


@pytest.fixture(autouse=True)
def _interpret(monkeypatch: pytest.MonkeyPatch) -> None:
    if INTERPRET:
        monkeypatch.setenv("TRITON_INTERPRET", "1")


def _int8_blocks(out_features: int, in_features: int, group: int) -> Int8Blocks:
    """Every int8 value, -128 and 127 included, with random scales and zeros per group."""
    q = torch.randint(-128, 128, (out_features, in_features), dtype=torch.int8)
    q[0, :2] = torch.tensor([-128, 127], dtype=torch.int8)
    groups = (out_features, in_features // group)
    return Int8Blocks(q, torch.rand(groups) / 64 + 1e-3, torch.randn(groups) / 8)


def _blocks(bits: int, out_features: int, in_features: int, group: int) -> Int4Blocks:
    if bits == 8:
        return _int8_blocks(out_features, in_features, group)
    q, scale, zero = quantize_int4(torch.randn(out_features, in_features), group)
    return Int4Blocks(q.to(torch.uint8), scale, zero)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16], ids=str)
@pytest.mark.parametrize(
    ("bits", "rows", "out_features", "in_features", "group"),
    [
        (4, 1, 48, 64, 32),
        (4, 5, 80, 128, 64),
        (4, 33, 16, 256, 128),
        (8, 1, 48, 96, 16),  # a GGUF's K-quant groups; 96 no multiple of a tile's 64 columns
        (8, 5, 80, 160, 32),  # Q8_0's and Q5's groups
        (8, 33, 16, 256, 128),  # GPTQ's
        (8, 3, 24, 144, 48),  # a group that is no multiple of a tile, nor a tile of it
    ],
)
def test_grouped_gemm_multiplies_by_the_dequantized_weight(
    dtype: torch.dtype, bits: int, rows: int, out_features: int, in_features: int, group: int
) -> None:
    torch.manual_seed(0)
    blocks = _blocks(bits, out_features, in_features, group)
    # The scales and zeros as the model dtype holds them.
    scale, zero = (t.to(dtype).float() for t in (blocks.scale, blocks.zero))
    blocks = type(blocks)(blocks.q, scale, zero)
    sz = torch.stack([scale, zero], dim=-1).transpose(0, 1).contiguous().to(dtype)
    x = torch.randn(rows, in_features).to(dtype)
    packed = pack_for_triton(blocks.q, bits)
    got = grouped_gemm(x.to(KERNEL_DEVICE), packed.to(KERNEL_DEVICE), sz.to(KERNEL_DEVICE), group, bits)
    assert got.dtype == dtype and got.shape == (rows, out_features)
    want = x.double() @ blocks.dequantized().double().t()
    tol = {torch.float32: 1e-4, torch.float16: 2e-2, torch.bfloat16: 5e-2}[dtype]
    torch.testing.assert_close(got.cpu().double(), want, rtol=tol, atol=tol * want.abs().max().item())


@pytest.mark.parametrize("bits", [4, 8])
def test_packing_for_triton_puts_each_pair_of_columns_in_one_row(bits: int) -> None:
    """Row ``i``, column ``n`` of the packed weight: output ``n``'s values at inputs ``2i`` (low
    nibble or byte) and ``2i + 1`` (high)."""
    blocks = _blocks(bits, 32, 64, 32)
    packed = pack_for_triton(blocks.q, bits)
    assert packed.shape == (32, 32) and packed.dtype == (torch.uint8 if bits == 4 else torch.int16)
    words = packed.t().to(torch.int32)
    low, high = (words & 15, words >> 4) if bits == 4 else ((words << 24) >> 24, words >> 8)
    assert torch.equal(low, blocks.q[:, 0::2].to(torch.int32))
    assert torch.equal(high, blocks.q[:, 1::2].to(torch.int32))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16], ids=str)
@pytest.mark.parametrize(
    ("rows", "out_features", "in_features", "group"),
    [
        (1, 48, 64, None),  # a scale per row
        (5, 80, 160, None),  # 160: no multiple of a tile's 64 columns
        (3, 40, 256, 128),  # blocks of 128 columns, as DeepSeek's and Qwen3's
        (33, 24, 96, 48),  # groups of 48: a tile of 32 columns reads two groups
        (2, 16, 100, 32),  # a short last group
    ],
)
def test_fp8_gemm_multiplies_by_the_dequantized_weight(
    dtype: torch.dtype, rows: int, out_features: int, in_features: int, group: int | None
) -> None:
    """Every e4m3 value (subnormals, zeros of both signs, ±448) times a float32 scale per row or
    per row and group."""
    torch.manual_seed(0)
    bits = torch.randint(0, 256, (out_features, in_features), dtype=torch.uint8)
    bits[bits & 0x7F == 0x7F] = 0x40  # no NaN
    bits[0, :4] = torch.tensor([0x00, 0x80, 0x7E, 0x01], dtype=torch.uint8)  # 0, -0, 448, 2^-9
    weight = bits.view(FP8)
    groups = 1 if group is None else -(-in_features // group)
    scale = torch.rand(out_features, groups) / 256 + 1e-4
    x = torch.randn(rows, in_features).to(dtype)
    got = fp8_gemm(
        x.to(KERNEL_DEVICE), weight.to(KERNEL_DEVICE), scale.to(KERNEL_DEVICE), group or in_features
    )
    assert got.dtype == dtype and got.shape == (rows, out_features)
    scales = scale.repeat_interleave(group or in_features, dim=1)[:, :in_features]
    want = x.double() @ (weight.double() * scales.double()).t()
    tol = {torch.float32: 1e-4, torch.float16: 2e-2, torch.bfloat16: 5e-2}[dtype]
    torch.testing.assert_close(got.cpu().double(), want, rtol=tol, atol=tol * want.abs().max().item())
