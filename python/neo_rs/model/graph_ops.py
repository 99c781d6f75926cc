"""The ``neo_rs::`` torch ops a compiled decoder stack holds as opaque nodes (``packed_linear``
here, ``decode_attention`` in ``worker/compiled.py``). They are defined through
``torch.library.Library`` rather than ``torch.library.custom_op``, whose checks on every call
(aliasing, metadata, a Dynamo-disabled wrapper) cost about 5 us against 2.5: a single stream makes
150 such calls a token."""

from __future__ import annotations

from collections.abc import Callable

import torch

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
