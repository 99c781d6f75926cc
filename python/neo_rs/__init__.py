"""neo_rs: online LLM inference with NEO-style CPU offloading of decode attention.

The Rust core (``neo_rs._core``) holds the scheduler, the KV block accounting and the CPU
paged-attention kernel; Python owns tensors and the model.
"""

from neo_rs.environment import use_our_inductor_cache

use_our_inductor_cache()  # before any import of torch._dynamo (``environment.py``)

from neo_rs._core import AttentionHandle, CpuAttention, Scheduler, SchedulerOutput, simd_tiers
from neo_rs.config import EngineArgs
from neo_rs.engine.llm import LLM
from neo_rs.engine.llm_engine import LLMEngine
from neo_rs.engine.sequence import CompletionOutput, RequestOutput
from neo_rs.errors import (
    BackendError,
    DTypeError,
    EngineDeadError,
    EngineStepError,
    InvalidArgumentError,
    ModelLoadError,
    NeoRsError,
    ShapeError,
)
from neo_rs.sample.sampling import RequestOutputKind, SamplingParams
from neo_rs.sample.structured import StructuredOutputsParams

__version__ = "0.1.0"

__all__ = [
    "LLM",
    "AttentionHandle",
    "BackendError",
    "CompletionOutput",
    "CpuAttention",
    "DTypeError",
    "EngineArgs",
    "EngineDeadError",
    "EngineStepError",
    "InvalidArgumentError",
    "LLMEngine",
    "ModelLoadError",
    "NeoRsError",
    "RequestOutput",
    "RequestOutputKind",
    "SamplingParams",
    "Scheduler",
    "SchedulerOutput",
    "ShapeError",
    "StructuredOutputsParams",
    "simd_tiers",
    "__version__",
]
