"""FP8 weight-only GEMM in Triton, for the CUDA ``Fp8Linear`` that ``torch._scaled_mm`` does not
take (before sm_89, fp16 and float32 models, and block-wise scales): each tile of the e4m3 weight
widened in registers and multiplied in the model dtype, so the weight is read at its one byte a
value, never widened in memory.

The weight is the checkpoint's own ``[out, in]`` e4m3, read as bytes: a byte's sign, exponent and
mantissa shifted into fp16's are the value / 2^8 exactly (subnormals too; ``fp8.widen`` does the
same on the host), put back by one multiply of the sums. ``scale`` is float32 ``[out, groups]``:
one per row (``groups`` 1, applied to the sums), or one per row and ``group`` input columns
(block-wise FP8, its blocks' rows expanded at load; the last group may be short), applied to the
tile. Runs under Triton's CPU interpreter, where CI tests it against the dequantized weight."""

from __future__ import annotations

from typing import Any

import torch
import triton
import triton.language as tl

from neo_rs.model.cuda.words import as_words, widen


@triton.jit
def _fp8_gemm(
    x_ptr, weight_ptr, scale_ptr, out_ptr,
    M, N, K, groups,
    stride_xm, stride_om,
    GROUP: tl.constexpr, PER_ROW: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    IS_BF16: tl.constexpr, PRECISION: tl.constexpr,
):  # fmt: skip
    m = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    m_ok, n_ok = m < M, n < N
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k = k0 + tl.arange(0, BLOCK_K)
        k_ok = k < K
        x = widen(
            tl.load(x_ptr + m[:, None] * stride_xm + k[None, :], m_ok[:, None] & k_ok[None, :], 0), IS_BF16
        )
        w_mask = k_ok[:, None] & n_ok[None, :]
        byte = tl.load(weight_ptr + n[None, :] * K + k[:, None], w_mask, 0).to(tl.int32)
        bits = ((byte & 0x80) << 8) | ((byte & 0x7F) << 7)
        w = bits.to(tl.uint16).to(tl.float16, bitcast=True).to(tl.float32)
        if not PER_ROW:
            if GROUP % BLOCK_K == 0:  # one scale per column for the whole tile
                w = w * tl.load(scale_ptr + n * groups + k0 // GROUP, n_ok, 0)[None, :]
            else:
                w = w * tl.load(scale_ptr + n[None, :] * groups + (k // GROUP)[:, None], w_mask, 0)
        acc += tl.dot(x, w, input_precision=PRECISION)
    acc = acc * 256.0  # the widened values were each value / 2^8
    if PER_ROW:
        acc = acc * tl.load(scale_ptr + n, n_ok, 0)[None, :]
    tl.store(out_ptr + m[:, None] * stride_om + n[None, :], acc, m_ok[:, None] & n_ok[None, :])


def fp8_launch(dtype: torch.dtype, group: int, per_row: bool) -> dict[str, Any]:
    """The GEMM's compile-time arguments for a dtype and ``group`` (block-wise scales) or
    ``per_row``, as ``benches/gpu_compile.py`` compiles them for each GPU target."""
    wide = dtype == torch.float32  # full-precision dot products: smaller tiles, or they spill
    return dict(
        GROUP=group,
        PER_ROW=per_row,
        BLOCK_M=16,  # tl.dot's minimum: decode batches are small
        BLOCK_N=32 if wide else 64,
        # 32 columns a tile: a T4 spilled the widened tile of 64 in fp16.
        BLOCK_K=32,
        IS_BF16=dtype == torch.bfloat16,
        # 16-bit inputs and e4m3 weights are exact in tf32; float32 models keep full precision.
        PRECISION="ieee" if dtype == torch.float32 else "tf32",
        num_warps=4,
    )


@torch.library.custom_op("neo_rs::fp8_gemm", mutates_args=())
def fp8_gemm(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor, group: int) -> torch.Tensor:
    """``x @ w.T`` (``x`` ``[M, in]``, the output in ``x``'s dtype) for the e4m3 ``weight``
    ``[out, in]`` times ``scale`` (float32 ``[out, groups]``: per row, or per row and ``group``
    input columns)."""
    m, k = x.shape
    n, groups = scale.shape
    x = x.contiguous()
    out = torch.empty(m, n, dtype=torch.float32, device=x.device)
    launch = fp8_launch(x.dtype, group, per_row=groups == 1)
    grid = (triton.cdiv(m, launch["BLOCK_M"]), triton.cdiv(n, launch["BLOCK_N"]))
    _fp8_gemm[grid](
        as_words(x), weight.view(torch.uint8), scale.contiguous(), out,
        m, n, k, groups,
        x.stride(0), out.stride(0),
        **launch,
    )  # fmt: skip
    return out.to(x.dtype)


@fp8_gemm.register_fake
def _(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor, group: int) -> torch.Tensor:
    devices = {t.device for t in (x, weight, scale)}
    if len(devices) > 1:
        raise ValueError(f"fp8_gemm arguments on different devices: {devices}")
    n, k = weight.shape
    if (
        weight.dtype != torch.float8_e4m3fn
        or x.shape[1] != k
        or scale.dtype != torch.float32
        or scale.shape not in ((n, 1), (n, -(-k // group)))
    ):
        raise ValueError(
            f"fp8_gemm: x {tuple(x.shape)}, weight {weight.dtype} {tuple(weight.shape)}, scales "
            f"{scale.dtype} {tuple(scale.shape)} in groups of {group}"
        )
    return x.new_empty(x.shape[0], n)
