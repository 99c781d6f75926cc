"""The exception hierarchy: every neo_rs error derives from ``NeoRsError``, and each class also
from the builtin it refines, so code that catches ``ValueError`` around vLLM calls works unchanged.
The Rust core raises these same classes."""


class NeoRsError(Exception):
    """Root of every neo_rs error."""


class ShapeError(NeoRsError, ValueError):
    """A tensor's shape or size does not fit the call."""


class DTypeError(NeoRsError, TypeError):
    """A tensor has the wrong dtype, or dtypes disagree."""


class InvalidArgumentError(NeoRsError, ValueError):
    """A value is out of range or not allowed."""


class BackendError(NeoRsError, RuntimeError):
    """The runtime cannot do what was asked."""


class ModelLoadError(NeoRsError, OSError):
    """A model cannot be loaded: missing files, unsupported architecture or quantization, bad weights."""


class EngineStepError(NeoRsError, RuntimeError):
    """An iteration failed; ``request_ids`` are the requests it aborted (their KV blocks are freed)."""

    def __init__(self, message: str, request_ids: list[str]) -> None:
        super().__init__(message)
        self.request_ids = request_ids


class EngineDeadError(EngineStepError):
    """The engine cannot go on (a tensor-parallel rank died or its ranks fell out of step): every
    open request is aborted, and every later call raises this again."""


__all__ = [
    "BackendError",
    "DTypeError",
    "EngineDeadError",
    "EngineStepError",
    "InvalidArgumentError",
    "ModelLoadError",
    "NeoRsError",
    "ShapeError",
]
