"""Int4 weight-only GEMM in Triton, for the GPUs where torch's tinygemm kernel does not run
(before sm_80, a T4's; or in float16): ``Int4Linear``'s weights, dequantized tile by tile in
registers as each is multiplied, after vLLM's Triton AWQ/GPTQ kernels.

The weight is ``packed`` uint8 ``[in / 2, out]``: byte ``(i, n)`` holds output column ``n``'s
values for input columns ``2i`` (low nibble) and ``2i + 1`` (high nibble), so that a program
multiplies the even and the odd input columns of its tile separately and nothing is interleaved
in registers. ``scales_zeros`` is tinygemm's ``[in / group, out, 2]`` in the model dtype: the
weight is ``(q - 8) * scale + zero``. bfloat16 is read as raw 16-bit words and widened by a shift,
as in the other kernels, so that it also runs under Triton's CPU interpreter, where CI tests it
against the torch path."""

from __future__ import annotations

from typing import Any

import torch
import triton
import triton.language as tl

from neo_rs.model.cuda.words import as_words, widen


@triton.jit
def _int4_gemm(
    x_ptr, packed_ptr, sz_ptr, out_ptr,
    M, N, K,
    stride_xm, stride_om,
    GROUP: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    IS_BF16: tl.constexpr, PRECISION: tl.constexpr,
):  # fmt: skip
    m = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    m_ok, n_ok = m < M, n < N
    pair = tl.arange(0, BLOCK_K // 2)  # the tile's byte rows: input columns 2i and 2i + 1
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for k0 in range(0, K, BLOCK_K):  # BLOCK_K divides GROUP: one scale and zero per tile
        even = k0 + 2 * pair
        x_at = x_ptr + m[:, None] * stride_xm + even[None, :]
        x_even = widen(tl.load(x_at, m_ok[:, None], 0), IS_BF16)
        x_odd = widen(tl.load(x_at + 1, m_ok[:, None], 0), IS_BF16)
        byte = tl.load(packed_ptr + (k0 // 2 + pair)[:, None] * N + n[None, :], n_ok[None, :], 0).to(tl.int32)
        sz_at = sz_ptr + ((k0 // GROUP) * N + n) * 2
        scale = widen(tl.load(sz_at, n_ok, 0), IS_BF16)[None, :]
        zero = widen(tl.load(sz_at + 1, n_ok, 0), IS_BF16)[None, :]
        w_even = ((byte & 15) - 8).to(tl.float32) * scale + zero
        w_odd = ((byte >> 4) - 8).to(tl.float32) * scale + zero
        acc += tl.dot(x_even, w_even, input_precision=PRECISION)
        acc += tl.dot(x_odd, w_odd, input_precision=PRECISION)
    tl.store(out_ptr + m[:, None] * stride_om + n[None, :], acc, m_ok[:, None] & n_ok[None, :])


def int4_launch(dtype: torch.dtype, group: int) -> dict[str, Any]:
    """The GEMM's compile-time arguments for a dtype and group size, as ``benches/gpu_compile.py``
    compiles them for each GPU target."""
    wide = dtype == torch.float32  # full-precision dot products: smaller tiles, or they spill
    return dict(
        GROUP=group,
        BLOCK_M=16,  # tl.dot's minimum: decode batches are small
        BLOCK_N=32 if wide else 64,
        BLOCK_K=min(group, 32 if wide else 64),
        IS_BF16=dtype == torch.bfloat16,
        # 16-bit inputs are exact in tf32; float32 models keep full precision.
        PRECISION="ieee" if dtype == torch.float32 else "tf32",
        num_warps=4,
    )


def pack_for_triton(q: torch.Tensor) -> torch.Tensor:
    """4-bit values ``q`` ``[out, in]`` as this kernel's ``packed`` ``[in / 2, out]``."""
    q = q.to(torch.uint8)
    return (q[:, 0::2] | q[:, 1::2] << 4).t().contiguous()


@torch.library.custom_op("neo_rs::int4_gemm", mutates_args=())
def int4_gemm(x: torch.Tensor, packed: torch.Tensor, scales_zeros: torch.Tensor, group: int) -> torch.Tensor:
    """``x @ w.T`` (``x`` ``[M, in]``, the output in ``x``'s dtype) for the int4 weight ``w``
    that ``packed`` (``pack_for_triton``) and ``scales_zeros`` (``[in / group, out, 2]``) hold."""
    m, k = x.shape
    n = packed.shape[1]
    x = x.contiguous()
    out = torch.empty(m, n, dtype=torch.float32, device=x.device)
    launch = int4_launch(x.dtype, group)
    grid = (triton.cdiv(m, launch["BLOCK_M"]), triton.cdiv(n, launch["BLOCK_N"]))
    _int4_gemm[grid](
        as_words(x), packed, as_words(scales_zeros.contiguous()), out,
        m, n, k,
        x.stride(0), out.stride(0),
        **launch,
    )  # fmt: skip
    return out.to(x.dtype)


@int4_gemm.register_fake
def _(x: torch.Tensor, packed: torch.Tensor, scales_zeros: torch.Tensor, group: int) -> torch.Tensor:
    devices = {t.device for t in (x, packed, scales_zeros)}
    if len(devices) > 1:
        raise ValueError(f"int4_gemm arguments on different devices: {devices}")
    k, n = x.shape[1], packed.shape[1]
    if packed.dtype != torch.uint8 or packed.shape[0] * 2 != k or scales_zeros.shape != (k // group, n, 2):
        raise ValueError(
            f"int4_gemm: x {tuple(x.shape)}, packed {packed.dtype} {tuple(packed.shape)}, scales and "
            f"zeros {tuple(scales_zeros.shape)} in groups of {group}"
        )
    if scales_zeros.dtype != x.dtype:
        raise ValueError(f"int4_gemm: scales in {scales_zeros.dtype}, x in {x.dtype}")
    return x.new_empty(x.shape[0], n)
