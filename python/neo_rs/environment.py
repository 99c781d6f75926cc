"""The environment the engine reads: its cache folder (and how things are built into it) and
the ``NEO_RS_*`` variables that switch emulations, backends and fault injection."""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path

from neo_rs.errors import InvalidArgumentError


def cache_dir() -> Path:
    """``NEO_RS_CACHE_DIR``, else ``~/.cache/neo_rs``: built-in models, converted GGUFs, perf profiles."""
    root = os.environ.get("NEO_RS_CACHE_DIR") or os.path.join(os.path.expanduser("~"), ".cache", "neo_rs")
    return Path(root)


def use_our_inductor_cache() -> None:
    """Inductor's compile cache under ``cache_dir()/inductor`` unless ``TORCHINDUCTOR_CACHE_DIR``
    is set: compiled decoder stacks (``worker/compiled.py``) then outlive a reboot's cleaning of
    ``/tmp``, Inductor's default. Called when ``neo_rs`` is imported: torch fixes the folder
    (writing its default into the variable) the first time ``torch._dynamo`` is imported."""
    os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", str(cache_dir() / "inductor"))


def build_atomically(target: Path, build: Callable[[Path], None]) -> None:
    """Run ``build`` into a fresh folder beside ``target``, then rename it into place: a crash
    leaves nothing half-written, and of two processes racing, one wins and the other's copy goes."""
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}-", dir=target.parent))
    try:
        build(tmp)
        try:
            tmp.rename(target)
        except OSError:  # another process won the race
            shutil.rmtree(tmp, ignore_errors=True)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def emulate_async_copies() -> bool:
    """``NEO_RS_EMULATE_ASYNC_COPIES=1``: on a CPU device, device->host copies land only when
    waited on, as on CUDA (``kv/transfer.py``)."""
    return os.environ.get("NEO_RS_EMULATE_ASYNC_COPIES", "") not in ("", "0")


def openmp_team() -> bool:
    """``NEO_RS_OPENMP_TEAM=0``: on a CPU device, the kernel keeps its own thread pool instead of
    running on torch's OpenMP threads (``runner.cpu_attention``), for comparison."""
    return os.environ.get("NEO_RS_OPENMP_TEAM", "1") != "0"


def device_attention() -> str:
    """``NEO_RS_DEVICE_ATTENTION``: the backend of device decodes on CUDA (``attention/device_decode.py``),
    ``flashinfer``, ``triton`` or ``torch``; default ``auto``, the first of them that imports
    (``benches/gpu_check.sh`` checks each)."""
    return os.environ.get("NEO_RS_DEVICE_ATTENTION", "auto")


def force_speculation() -> bool:
    """``NEO_RS_FORCE_SPECULATION=1``: tests verify every draft prompt lookup finds, whatever the
    predictor says drafts are worth on this machine (``rust/sched/scheduler/speculate.rs``)."""
    return os.environ.get("NEO_RS_FORCE_SPECULATION", "") not in ("", "0")


def forced_acceptance() -> float | None:
    """``NEO_RS_FORCE_ACCEPTANCE=p``, benchmarks only: each draft is kept with probability ``p``
    (once those before it were), whatever the model samples there, to time speculation at an
    acceptance a random-weight model never reaches (``benches/spec_decode.py``). Outputs are then
    no longer the model's."""
    value = os.environ.get("NEO_RS_FORCE_ACCEPTANCE", "")
    return float(value) if value else None


CPU_GEMMS = ("auto", "bfloat16", "float32")


def cpu_gemm() -> str:
    """``NEO_RS_CPU_GEMM``: what a CPU device's bf16 linears of many rows compute in (``model/packed.py``):
    ``bfloat16`` (oneDNN on the bf16 weight), ``float32`` (oneDNN on a widened copy), or ``auto``,
    the default: ``float32`` where it runs faster on this CPU and its copy fits in memory."""
    value = os.environ.get("NEO_RS_CPU_GEMM", "auto")
    if value not in CPU_GEMMS:
        raise InvalidArgumentError(f"NEO_RS_CPU_GEMM must be one of {', '.join(CPU_GEMMS)}, got {value!r}")
    return value


def enforce_eager_default() -> bool:
    """``NEO_RS_ENFORCE_EAGER=1``: engines that do not say run op by op (``EngineArgs.enforce_eager``);
    the test suite sets it, and tests of the compiled stack ask for it."""
    return os.environ.get("NEO_RS_ENFORCE_EAGER", "") not in ("", "0")


def fail_steps() -> str:
    """``NEO_RS_FAIL_STEPS``: model runs that raise, for fault-injection tests (``worker/faults.py``)."""
    return os.environ.get("NEO_RS_FAIL_STEPS", "")


def fail_rank() -> int:
    """``NEO_RS_FAIL_RANK``: the tensor-parallel rank ``NEO_RS_FAIL_STEPS`` applies to (default 0)."""
    try:
        return int(os.environ.get("NEO_RS_FAIL_RANK", "0"))
    except ValueError as e:
        raise InvalidArgumentError("NEO_RS_FAIL_RANK must be an integer") from e
