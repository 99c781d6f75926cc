"""Prepacked bf16 linears when the device is the CPU. A bf16 ``F.linear`` on the CPU goes to
oneDNN, which reorders the weight into its blocked layout on every call. Reordering once at load
gives the same output, bit for bit, in less time: 1.1-1.4x per GEMM for SmolLM2's shapes at 64 rows
(``python benches/cpu_serving.py`` measures it end to end; ``NEO_RS_PACK_LINEARS=0`` turns it off
for the comparison).

Under ``torch.compile`` (``worker/compiled.py``) the packed weight cannot enter the graph: an
opaque oneDNN tensor has no fake counterpart to trace with. So the graph calls the op
``neo_rs::packed_linear`` with the linear's slot, and the op finds the weight in the table bound
for the call (``bound_linears``)."""

from __future__ import annotations

import os
import threading
from collections.abc import Iterator
from contextlib import contextmanager

import torch
from torch import nn

from neo_rs.model.moe import SparseMoe


def packing_applies(device: torch.device, dtype: torch.dtype) -> bool:
    """bf16 on a CPU oneDNN runs natively (AVX512-BF16 or AMX), unless turned off."""
    return (
        device.type == "cpu"
        and dtype == torch.bfloat16
        and os.environ.get("NEO_RS_PACK_LINEARS", "1") != "0"
        and bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
    )


class PackedLinear(nn.Module):
    """An ``nn.Linear`` whose weight oneDNN has reordered (the layout depends on ``rows``, the
    usual number of rows; any number is computed exactly)."""

    def __init__(self, linear: nn.Linear, rows: int) -> None:
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        # A plain attribute: an opaque oneDNN tensor, never moved or saved.
        self.packed = torch.ops.mkldnn._reorder_linear_weight(linear.weight.detach(), rows)
        self.bias = linear.bias
        self.slot = -1  # its index in the table a compiled graph binds (``number_linears``)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if torch.compiler.is_compiling():
            assert self.slot >= 0, "a compiled model numbers its packed linears first"
            return torch.ops.neo_rs.packed_linear(x, self.slot, self.out_features)
        return self.linear(x)

    def linear(self, x: torch.Tensor) -> torch.Tensor:
        return torch.ops.mkldnn._linear_pointwise(x, self.packed, self.bias, "none", [], "")


_bound = threading.local()


@torch.library.custom_op("neo_rs::packed_linear", mutates_args=())
def _packed_linear(x: torch.Tensor, slot: int, out_features: int) -> torch.Tensor:
    linears: list[PackedLinear] = _bound.linears
    return linears[slot].linear(x)


@_packed_linear.register_fake
def _(x: torch.Tensor, slot: int, out_features: int) -> torch.Tensor:
    return x.new_empty((*x.shape[:-1], out_features))


def number_linears(model: nn.Module) -> list[PackedLinear]:
    """The model's packed linears, each told its slot in the returned table."""
    linears = [m for m in model.modules() if isinstance(m, PackedLinear)]
    for slot, m in enumerate(linears):
        m.slot = slot
    return linears


@contextmanager
def bound_linears(linears: list[PackedLinear]) -> Iterator[None]:
    """The table ``neo_rs::packed_linear`` reads in this thread while the block runs."""
    _bound.linears = linears
    try:
        yield
    finally:
        _bound.linears = None


def pack_linears(model: nn.Module, rows: int) -> int:
    """Replace each linear that owns its weight (a tied LM head shares the embedding's, which
    packing would copy), and pack each MoE layer's experts; returns how many linears."""
    shared = {
        id(p) for m in model.modules() if not isinstance(m, nn.Linear) for p in m.parameters(recurse=False)
    }
    count = 0
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if isinstance(child, nn.Linear) and id(child.weight) not in shared:
                setattr(parent, name, PackedLinear(child, rows))
                count += 1
        if isinstance(parent, SparseMoe):
            parent.pack(PackedLinear, rows)
            count += 2 * parent.num_experts
    return count
