"""neo_rs: online LLM inference with NEO-style CPU offloading of decode attention.

The Rust core (``neo_rs._core``) holds the CPU paged-attention kernel; Python owns tensors.
"""

from neo_rs._core import (
    AttentionHandle,
    BackendError,
    CpuAttention,
    DTypeError,
    InvalidArgumentError,
    NeoRsError,
    ShapeError,
    simd_tiers,
)

__version__ = "0.1.0"

__all__ = [
    "AttentionHandle",
    "BackendError",
    "CpuAttention",
    "DTypeError",
    "InvalidArgumentError",
    "NeoRsError",
    "ShapeError",
    "simd_tiers",
    "__version__",
]
