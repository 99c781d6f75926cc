"""The exception hierarchy: every neo_rs error derives from ``NeoRsError`` (defined by the Rust
core, so Rust and Python errors are caught alike)."""

from neo_rs._core import (
    BackendError,
    DTypeError,
    InvalidArgumentError,
    NeoRsError,
    ShapeError,
)


class ModelLoadError(NeoRsError):
    """A model directory cannot be loaded: missing files, unsupported architecture, bad weights."""


__all__ = [
    "BackendError",
    "DTypeError",
    "InvalidArgumentError",
    "ModelLoadError",
    "NeoRsError",
    "ShapeError",
]
