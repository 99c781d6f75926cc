"""Weight-only GEMM in Triton over weights quantized in groups, dequantized tile by tile in
registers as each is multiplied (after vLLM's Triton AWQ/GPTQ kernels), for the CUDA linears no
torch kernel takes:

- 4 bits (``Int4Linear`` where torch's tinygemm does not run: before sm_80, a T4's, or in
  float16), ``w = (q - 8) * scale + zero``;
- 8 bits (``GroupedInt8Linear``: a GGUF's blocks of 5, 6 or 8 bits, 8-bit GPTQ), ``w = q * scale
  + zero`` with ``q`` an int8.

``packed`` pairs the input columns: row ``i`` holds output column ``n``'s values for input
columns ``2i`` and ``2i + 1``, as a byte's low and high nibble (4 bits, uint8 ``[in / 2, out]``)
or a word's low and high byte (8 bits, int16), so that a program multiplies the even and the odd
input columns of its tile separately and nothing is interleaved in registers. ``scales_zeros`` is
tinygemm's ``[in / group, out, 2]`` in the model dtype. bfloat16 is read as raw 16-bit words and
widened by a shift, as in the other kernels, so that it also runs under Triton's CPU interpreter,
where CI tests it against the dequantized weight."""

from __future__ import annotations

from typing import Any

import torch
import triton
import triton.language as tl

from neo_rs.model.cuda.words import as_words, widen

# The widths the kernel takes, and the dtype of each one's packed pairs.
PACKED_DTYPE = {4: torch.uint8, 8: torch.int16}


@triton.jit
def _grouped_gemm(
    x_ptr, packed_ptr, sz_ptr, out_ptr,
    M, N, K,
    stride_xm, stride_om,
    GROUP: tl.constexpr, BITS: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    IS_BF16: tl.constexpr, PRECISION: tl.constexpr,
):  # fmt: skip
    m = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    m_ok, n_ok = m < M, n < N
    pair = tl.arange(0, BLOCK_K // 2)  # the tile's packed rows: input columns 2i and 2i + 1
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for k0 in range(0, K, BLOCK_K):
        even = k0 + 2 * pair
        k_ok = even < K  # K is even: a pair is whole or out
        x_at = x_ptr + m[:, None] * stride_xm + even[None, :]
        x_mask = m_ok[:, None] & k_ok[None, :]
        x_even = widen(tl.load(x_at, x_mask, 0), IS_BF16)
        x_odd = widen(tl.load(x_at + 1, x_mask, 0), IS_BF16)
        w_mask = k_ok[:, None] & n_ok[None, :]
        word = tl.load(packed_ptr + (k0 // 2 + pair)[:, None] * N + n[None, :], w_mask, 0).to(tl.int32)
        if BITS == 4:
            q_even, q_odd = (word & 15) - 8, (word >> 4) - 8
        else:  # the int16 word sign-extended: its low byte shifted up and back, its high byte down
            q_even, q_odd = (word << 24) >> 24, word >> 8
        if GROUP % BLOCK_K == 0:  # one scale and zero per column for the whole tile
            sz_at = sz_ptr + ((k0 // GROUP) * N + n) * 2
            scale = widen(tl.load(sz_at, n_ok, 0), IS_BF16)[None, :]
            zero = widen(tl.load(sz_at + 1, n_ok, 0), IS_BF16)[None, :]
        else:  # a pair's two columns share a group (GROUP is even)
            sz_at = sz_ptr + ((even // GROUP)[:, None] * N + n[None, :]) * 2
            scale = widen(tl.load(sz_at, w_mask, 0), IS_BF16)
            zero = widen(tl.load(sz_at + 1, w_mask, 0), IS_BF16)
        w_even = q_even.to(tl.float32) * scale + zero
        w_odd = q_odd.to(tl.float32) * scale + zero
        acc += tl.dot(x_even, w_even, input_precision=PRECISION)
        acc += tl.dot(x_odd, w_odd, input_precision=PRECISION)
    tl.store(out_ptr + m[:, None] * stride_om + n[None, :], acc, m_ok[:, None] & n_ok[None, :])


def grouped_launch(dtype: torch.dtype, group: int, bits: int) -> dict[str, Any]:
    """The GEMM's compile-time arguments for a dtype, group size and width, as
    ``benches/gpu_compile.py`` compiles them for each GPU target."""
    wide = dtype == torch.float32  # full-precision dot products: smaller tiles, or they spill
    columns = 32 if wide else 64
    return dict(
        GROUP=group,
        BITS=bits,
        BLOCK_M=16,  # tl.dot's minimum: decode batches are small
        BLOCK_N=32 if wide else 64,
        # Input columns a tile: 16 pairs at least (tl.dot's minimum), over several groups where
        # they are smaller (a GGUF's of 16).
        BLOCK_K=columns if group >= columns else 32,
        IS_BF16=dtype == torch.bfloat16,
        # 16-bit inputs are exact in tf32; float32 models keep full precision.
        PRECISION="ieee" if dtype == torch.float32 else "tf32",
        num_warps=4,
    )


def pack_for_triton(q: torch.Tensor, bits: int) -> torch.Tensor:
    """Values ``q`` ``[out, in]`` (4 bits: 0..15; 8 bits: int8) as this kernel's ``packed``
    ``[in / 2, out]``."""
    if bits == 4:
        q = q.to(torch.uint8)
        return (q[:, 0::2] | q[:, 1::2] << 4).t().contiguous()
    q = q.to(torch.int16)
    return ((q[:, 0::2] & 0xFF) | q[:, 1::2] << 8).t().contiguous()


@torch.library.custom_op("neo_rs::grouped_gemm", mutates_args=())
def grouped_gemm(
    x: torch.Tensor, packed: torch.Tensor, scales_zeros: torch.Tensor, group: int, bits: int
) -> torch.Tensor:
    """``x @ w.T`` (``x`` ``[M, in]``, the output in ``x``'s dtype) for the weight ``w`` of
    ``bits`` that ``packed`` (``pack_for_triton``) and ``scales_zeros`` (``[in / group, out,
    2]``) hold."""
    m, k = x.shape
    n = packed.shape[1]
    x = x.contiguous()
    out = torch.empty(m, n, dtype=torch.float32, device=x.device)
    launch = grouped_launch(x.dtype, group, bits)
    grid = (triton.cdiv(m, launch["BLOCK_M"]), triton.cdiv(n, launch["BLOCK_N"]))
    _grouped_gemm[grid](
        as_words(x), packed, as_words(scales_zeros.contiguous()), out,
        m, n, k,
        x.stride(0), out.stride(0),
        **launch,
    )  # fmt: skip
    return out.to(x.dtype)


@grouped_gemm.register_fake
def _(
    x: torch.Tensor, packed: torch.Tensor, scales_zeros: torch.Tensor, group: int, bits: int
) -> torch.Tensor:
    devices = {t.device for t in (x, packed, scales_zeros)}
    if len(devices) > 1:
        raise ValueError(f"grouped_gemm arguments on different devices: {devices}")
    k, n = x.shape[1], packed.shape[1]
    if (
        packed.dtype != PACKED_DTYPE.get(bits)
        or group % 2
        or k % group
        or packed.shape[0] * 2 != k
        or scales_zeros.shape != (k // group, n, 2)
    ):
        raise ValueError(
            f"grouped_gemm: x {tuple(x.shape)}, {bits}-bit packed {packed.dtype} {tuple(packed.shape)}, "
            f"scales and zeros {tuple(scales_zeros.shape)} in groups of {group}"
        )
    if scales_zeros.dtype != x.dtype:
        raise ValueError(f"grouped_gemm: scales in {scales_zeros.dtype}, x in {x.dtype}")
    return x.new_empty(x.shape[0], n)
