"""FP8 weights (``--quantization fp8``): each decoder linear's weight in e4m3 with a float32 scale
per output channel (``scale = max|row| / 448``), quantized at load, or an FP8 checkpoint's own
(``fp8_checkpoint.py``: per channel, per tensor, or per block of rows and input columns), and kept
so: half of bf16's bytes. Three ways to multiply, picked per device:

- CUDA sm_89 and newer, bf16, a scale per row: ``torch._scaled_mm`` in FP8 on both sides, the
  activations scaled per token at each call (vLLM's dynamic FP8);
- elsewhere on CUDA (older GPUs, other dtypes, block-wise scales) weight-only: our Triton GEMM
  (``cuda/fp8_gemm.py``) widens each tile in registers;
- on the CPU weight-only: the weight widened at each call and multiplied in the model dtype.
  Widening shifts e4m3's sign, exponent and mantissa bits into fp16's, which is exact (each value
  divided by 2^8, put back with the scale); on the CPU it takes half the time of torch's own e4m3
  cast (one stream of SmolLM2: 118 ms a token against 238, ``benches/quant_linear.py``), still
  several times bf16's: there FP8 saves memory, and int8 or int4 are the CPU's formats for speed."""

from __future__ import annotations

from typing import NamedTuple

import torch
from torch import nn
from torch.nn import functional as F

FP8 = torch.float8_e4m3fn
FP8_MAX = torch.finfo(FP8).max
# torch's FP8 GEMM with a scale per row of each side (Ada and Hopper), bf16 out.
SCALED_MM_CAPABILITY = (8, 9)
_WIDENED = 2.0**8  # e4m3 bits read as fp16 are the value / 2^8


def quantize_fp8(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``w`` ``[out, in]`` as e4m3 rows and their float32 scales (``w ≈ q * scale[:, None]``); an
    all-zero row gets scale 0."""
    w = w.detach().float()
    scale = w.abs().amax(dim=1) / FP8_MAX
    q = (w / scale.clamp_min(torch.finfo(torch.float32).tiny)[:, None]).clamp_(-FP8_MAX, FP8_MAX)
    return q.to(FP8), scale


def widen(q: torch.Tensor) -> torch.Tensor:
    """e4m3 ``q`` as fp16 holding each value / 2^8, exactly: e4m3's exponent (bias 7) lands in
    fp16's (bias 15), its mantissa on top of fp16's; subnormals map to subnormals."""
    bits = q.view(torch.uint8).to(torch.int16)
    return ((bits & 0x80) << 8 | (bits & 0x7F) << 7).view(torch.float16)


def scaled_mm_runs(device: torch.device, capability: tuple[int, int] | None, dtype: torch.dtype) -> bool:
    """Whether ``torch._scaled_mm`` multiplies here: a CUDA GPU of sm_89 or newer, in bf16."""
    return (
        device.type == "cuda"
        and capability is not None
        and capability >= SCALED_MM_CAPABILITY
        and (dtype == torch.bfloat16)
    )


class Fp8Weights(NamedTuple):
    """An e4m3 weight ``q`` ``[out, in]`` and its float32 ``scale`` ``[out, groups]``: one per row
    (``groups`` 1), or one per row and ``group`` input columns (the last group may be short)."""

    q: torch.Tensor
    scale: torch.Tensor
    group: int

    def dequantized(self) -> torch.Tensor:
        """The float32 weight: each value times its row's (and group's) scale."""
        scales = self.scale.repeat_interleave(self.group, dim=1)[:, : self.q.shape[1]]
        return widen(self.q).float() * (scales * _WIDENED)


class Fp8Linear(nn.Module):
    """An ``nn.Linear`` whose weight is ``Fp8Weights`` (``weights``: a checkpoint's, else
    ``linear``'s weight quantized per row); the output is in the input's dtype. ``scaled_mm``:
    multiply in FP8 where ``scaled_mm_runs`` and the scales are per row."""

    weight: torch.Tensor
    scale: torch.Tensor

    def __init__(
        self,
        linear: nn.Linear,
        scaled_mm: bool = False,
        weights: Fp8Weights | None = None,
        home: torch.Tensor | None = None,
    ) -> None:
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        # ``home``: a tensor on the model's device, where ``linear``'s weight is not (see
        # ``quant.GroupedLinear``).
        if weights is None:
            q, row_scale = quantize_fp8(linear.weight)
            weights = Fp8Weights(q, row_scale[:, None], self.in_features)
        q, scale, self.group = weights
        device = (linear.weight if home is None else home).device
        self.register_buffer("weight", q.to(device))
        self.register_buffer("scale", scale.to(device))
        self.bias = linear.bias
        per_row = scale.shape[1] == 1
        # _scaled_mm takes widths in multiples of 16.
        widths = self.in_features % 16 == 0 and self.out_features % 16 == 0
        self.scaled_mm = scaled_mm and per_row and widths
        self.on_cuda = device.type == "cuda"
        if self.on_cuda and not self.scaled_mm:
            from neo_rs.model.cuda.fp8_gemm import fp8_gemm  # noqa: PLC0415 (needs Triton)

            self._fp8_gemm = fp8_gemm  # bound once: forward runs per layer and step

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.reshape(-1, self.in_features)
        if self.scaled_mm:
            per_token = rows.abs().amax(dim=1, keepdim=True).float().clamp_min(1e-12) / FP8_MAX
            x8 = (rows / per_token).clamp(-FP8_MAX, FP8_MAX).to(FP8)
            y = torch._scaled_mm(
                x8,
                self.weight.t(),
                scale_a=per_token,
                scale_b=self.scale.reshape(1, -1),
                out_dtype=rows.dtype,
            )
        elif self.on_cuda:
            y = self._fp8_gemm(rows, self.weight, self.scale, self.group)
        elif self.scale.shape[1] == 1:
            y = F.linear(rows, widen(self.weight).to(rows.dtype))
            y = y * (self.scale[:, 0] * _WIDENED).to(rows.dtype)
        else:  # block-wise scales: the weight dequantized at each call
            y = F.linear(rows, self.dequantized().to(rows.dtype))
        if self.bias is not None:
            y = y + self.bias
        return y.reshape(*x.shape[:-1], self.out_features)

    def dequantized(self) -> torch.Tensor:
        """The float32 weight it stands for."""
        return Fp8Weights(self.weight, self.scale, self.group).dequantized()
