"""Weight-only int8 linears (``--quantization int8``, vLLM's name): each decoder linear's weight
quantized at load to int8 per output channel (symmetric, ``scale = max|row| / 127``), kept so
in memory, and multiplied by torch's ``_weight_int8pack_mm`` (CPU and CUDA kernels): activations
stay in the model dtype and the weight is read at half of bf16's bytes, which is what bounds
decode at small batches. The embeddings and the LM head stay unquantized, as vLLM keeps them,
and so do an MoE layer's experts (not yet quantized; the log says so)."""

from __future__ import annotations

import logging

import torch
from torch import nn

from neo_rs.config import QUANTIZATIONS
from neo_rs.model.moe import SparseMoe

log = logging.getLogger(__name__)


def quantize_int8(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``w`` ``[out, in]`` as int8 rows and their float32 scales (``w ≈ q * scale[:, None]``);
    rounded half to even, an all-zero row gets scale 0."""
    w = w.detach().float()
    scale = w.abs().amax(dim=1) / 127
    q = torch.round(w / scale.clamp_min(torch.finfo(torch.float32).tiny)[:, None]).clamp_(-127, 127)
    return q.to(torch.int8), scale


class Int8Linear(nn.Module):
    """An ``nn.Linear`` whose weight is int8 with a scale per output row (in the model dtype, as
    the kernel takes them); the output is in the input's dtype."""

    weight: torch.Tensor
    scales: torch.Tensor

    def __init__(self, linear: nn.Linear) -> None:
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        q, scale = quantize_int8(linear.weight)
        self.register_buffer("weight", q.to(linear.weight.device))
        self.register_buffer("scales", scale.to(linear.weight.device, linear.weight.dtype))
        self.bias = linear.bias

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.reshape(-1, self.in_features)
        y = torch._weight_int8pack_mm(rows, self.weight, self.scales)
        if self.bias is not None:
            y = y + self.bias
        return y.reshape(*x.shape[:-1], self.out_features)

    def dequantized(self) -> torch.Tensor:
        """The weight the kernel multiplies by, in the scales' dtype (tests compare against it)."""
        return self.weight.to(self.scales.dtype) * self.scales[:, None]


def quantize_linears(model: nn.Module, method: str) -> int:
    """Replace each decoder layer's linears (attention and dense MLP) by ``method``'s; returns how
    many. The embeddings, the LM head and MoE layers (router and experts) are left as they are."""
    assert method in QUANTIZATIONS, method
    count, sparse = 0, 0
    for layer in getattr(model, "decoder_layers", []):
        for parent in (layer, layer.mlp):
            if isinstance(parent, SparseMoe):
                sparse += 1
                continue
            for name, child in list(parent.named_children()):
                if isinstance(child, nn.Linear):
                    setattr(parent, name, Int8Linear(child))
                    count += 1
    if sparse:
        log.warning("%d MoE layers keep their experts unquantized (%s covers dense linears)", sparse, method)
    return count
