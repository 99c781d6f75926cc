"""The ``neo_rs::`` torch ops a compiled decoder stack holds as opaque nodes (``packed_linear``
here, ``decode_attention`` in ``worker/compiled.py``). They are defined through
``torch.library.Library`` rather than ``torch.library.custom_op``, whose checks on every call
(aliasing, metadata, a Dynamo-disabled wrapper) cost about 5 us against 2.5: a single stream makes
150 such calls a token.

``packed_linear`` runs the CPU linears whose weights cannot enter a graph (``GraphLinear``: an
opaque oneDNN tensor, a Rust kernel's object): the graph calls the op with the linear's slot, and
the op finds the linear in the table bound for the call (``bound_linears``)."""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager

import torch
from torch import nn

# A fragment: the CUDA modules define more ``neo_rs::`` ops through ``custom_op`` (its own fragments).
_LIB = torch.library.Library("neo_rs", "FRAGMENT")

Impl = Callable[..., torch.Tensor]


def graph_op(schema: str, fake: Impl) -> Callable[[Impl], Impl]:
    """Define ``neo_rs::<schema>`` with the decorated function as its CPU kernel and ``fake`` as
    its shape function for tracing; the function is returned unchanged."""
    name = schema.split("(", 1)[0]

    def define(impl: Impl) -> Impl:
        _LIB.define(schema)
        _LIB.impl(name, impl, "CPU")
        torch.library.register_fake(f"neo_rs::{name}", fake, lib=_LIB)
        return impl

    return define


class GraphLinear:
    """A linear a compiled graph reaches through ``neo_rs::packed_linear`` (mixed into an
    ``nn.Module`` with ``out_features`` and ``linear``, its eager computation)."""

    slot = -1  # its index in the table a compiled graph binds (``number_linears``)
    out_features: int

    def linear(self, x: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def graph_dtype(self, x: torch.Tensor) -> torch.dtype:
        """The dtype a graph hands the op ``x`` in: where ``linear`` computes in another than the
        input's (``PackedLinear``'s f32), the graph casts to it and back around the op, so that the
        casts fuse into the kernels beside it rather than run as ops of their own."""
        return x.dtype

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if torch.compiler.is_compiling():
            assert self.slot >= 0, "a compiled model numbers its graph linears first"
            dtype = self.graph_dtype(x)
            if dtype == x.dtype:
                return torch.ops.neo_rs.packed_linear(x, self.slot, self.out_features)
            return torch.ops.neo_rs.packed_linear(x.to(dtype), self.slot, self.out_features).to(x.dtype)
        return self.linear(x)


_bound = threading.local()


def _packed_linear_shape(x: torch.Tensor, slot: int, out_features: int) -> torch.Tensor:
    return x.new_empty((*x.shape[:-1], out_features))


@graph_op("packed_linear(Tensor x, int slot, int out_features) -> Tensor", _packed_linear_shape)
def _packed_linear(x: torch.Tensor, slot: int, out_features: int) -> torch.Tensor:
    linears: list[GraphLinear] = _bound.linears
    return linears[slot].linear(x)


def number_linears(model: nn.Module) -> list[GraphLinear]:
    """The model's graph linears, each told its slot in the returned table."""
    linears: list[GraphLinear] = [m for m in model.modules() if isinstance(m, GraphLinear)]
    for slot, m in enumerate(linears):
        m.slot = slot
    return linears


@contextmanager
def bound_linears(linears: list[GraphLinear]) -> Iterator[None]:
    """The table ``neo_rs::packed_linear`` reads in this thread while the block runs."""
    _bound.linears = linears
    try:
        yield
    finally:
        _bound.linears = None
