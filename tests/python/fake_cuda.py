"""A GPU that is not there: CUDA tensors as ``FakeTensorMode`` makes them (metadata, no memory),
host tensors real, and a ``CudaRuntime`` that answers for the driver (``neo_rs.cuda_runtime``).
The engine runs its own CUDA code path on it; ``CudaChecks`` watches every tensor operation for
what would go wrong on a real GPU:

- an operation mixing CUDA tensors with host tensors (beyond 0-d scalars and explicit copies),
  which torch would refuse or, for an index, turn into a hidden copy;
- a host sync: a scalar read of a CUDA tensor (``.item()``, ``bool()``, ``int()``), a
  device->host copy into pageable memory, ``synchronize()``; counted per iteration, against
  the budget ``docs/gpu.md`` states;
- an output whose size depends on data (``nonzero``, boolean masks): ``FakeTensorMode`` refuses
  them, as a capturable iteration must.

Host tensors stay real because the Rust CPU kernel reads their memory; values that come back
from the device (``CudaRuntime.read``) are made up by ``values``."""

from __future__ import annotations

import os
import time
import traceback
import weakref
from collections import Counter
from collections.abc import Callable, Iterator
from contextlib import ExitStack, contextmanager
from multiprocessing.connection import Connection
from typing import Any
from unittest.mock import patch

import torch
import torch.distributed.distributed_c10d as c10d
from neo_rs.cuda_runtime import CudaRuntime, use_runtime
from neo_rs.worker.graphs import Replayed
from neo_rs.worker.runner import ModelRunner
from neo_rs.worker.tp_workers import run_worker
from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode, unset_fake_temporarily
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves, tree_map_only
from torch.utils.weak import WeakIdKeyDictionary

GIB = 1 << 30
aten = torch.ops.aten


class DeviceCheckError(AssertionError):
    """What a real GPU would have refused or stalled on."""


class FakeEvent:
    """A CUDA event: ``record`` notes the host's clock (a fake device runs as it is issued)."""

    def __init__(self, runtime: FakeCuda) -> None:
        self.runtime, self.at = runtime, None

    def record(self, stream: Any = None) -> None:
        self.at = time.perf_counter()

    def synchronize(self) -> None:
        self.runtime.event_waits += 1

    def elapsed_time(self, end: FakeEvent) -> float:
        assert self.at is not None and end.at is not None, "elapsed_time of an event never recorded"
        return (end.at - self.at) * 1e3


class FakeStream:
    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.waited: list[FakeEvent] = []

    def wait_event(self, event: FakeEvent) -> None:
        self.waited.append(event)


class FakeCuda(CudaRuntime):
    """The driver's answers for one GPU of ``total_bytes`` (sm_90 unless ``capability``), with
    ``used_bytes`` taken by something else. ``values(t)`` makes up what a device read returns
    (by default token ids counting up from 1, for integer tensors). With ``track_memory``, free
    memory also leaves out what torch's caching allocator would hold: the most the CUDA tensors
    alive at once ever took, down to what is alive at each ``empty_cache()``; ``peak_bytes`` is
    that most, never reset."""

    def __init__(
        self,
        total_bytes: int = 80 * GIB,
        used_bytes: int = 0,
        capability: tuple[int, int] = (9, 0),
        values: Callable[[torch.Tensor], list[Any]] | None = None,
        track_memory: bool = False,
    ) -> None:
        self.total_bytes, self.used_bytes, self.cap = total_bytes, used_bytes, capability
        self.track_memory = track_memory
        self.live_bytes = self.reserved_bytes = self.peak_bytes = 0
        self._storages = WeakIdKeyDictionary()  # the CUDA storages seen alive
        self.values = values or self._counting
        self.synchronizes = 0
        self.event_waits = 0
        self.reads = 0
        self.captures = 0
        self.cache_empties = 0
        self._pinned: set[int] = set()  # storage addresses of live pinned buffers
        self._next = 0

    def _counting(self, t: torch.Tensor) -> list[Any]:
        n = t.numel()
        out = [(self._next + i) % 200 + 1 for i in range(n)]
        self._next += n
        return out if t.dim() == 1 else torch.tensor(out).reshape(t.shape).tolist()

    def available(self) -> bool:
        return True

    def capability(self, device: torch.device) -> tuple[int, int]:
        return self.cap

    def device_name(self, device: torch.device) -> str:
        return f"fake sm_{self.cap[0]}{self.cap[1]} ({self.total_bytes // GIB} GiB)"

    def mem_get_info(self, device: torch.device) -> tuple[int, int]:
        return self.total_bytes - self.used_bytes - self.reserved_bytes, self.total_bytes

    def allocated(self, out: Any) -> None:
        """Count the CUDA storages of an operation's outputs not seen before (``track_memory``)."""
        if not self.track_memory:
            return
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor) and t.device.type == "cuda":
                storage = t.untyped_storage()
                if storage not in self._storages:
                    self._storages[storage] = n = storage.nbytes()
                    self.live_bytes += n
                    weakref.finalize(storage, self._freed, n)
        self.reserved_bytes = max(self.reserved_bytes, self.live_bytes)
        self.peak_bytes = max(self.peak_bytes, self.live_bytes)

    def _freed(self, nbytes: int) -> None:
        self.live_bytes -= nbytes

    def set_device(self, device: torch.device) -> None:
        pass

    def synchronize(self, device: torch.device | None = None) -> None:
        self.synchronizes += 1

    def empty_cache(self) -> None:
        self.cache_empties += 1
        self.reserved_bytes = self.live_bytes

    def collective_backend(self) -> str:
        """torch's fake process group: collectives on fake tensors that move nothing (the
        control plane, host tensors over gloo, runs for real)."""
        import torch.testing._internal.distributed.fake_pg  # noqa: F401  (registers "fake")

        return "fake"

    def new_stream(self, device: torch.device) -> FakeStream:
        return FakeStream(device)

    @contextmanager
    def on_stream(self, stream: Any) -> Iterator[Any]:
        yield stream

    def new_event(self, enable_timing: bool = False) -> FakeEvent:
        return FakeEvent(self)

    def record_stream(self, t: torch.Tensor, stream: Any) -> None:
        if t.device.type != "cuda":
            raise DeviceCheckError(f"record_stream of a {t.device} tensor")

    def pinned_empty(self, shape: tuple[int, ...] | torch.Size, dtype: torch.dtype) -> torch.Tensor:
        t = torch.empty(shape, dtype=dtype)
        ptr = t.untyped_storage().data_ptr()
        self._pinned.add(ptr)
        weakref.finalize(t, self._pinned.discard, ptr)
        return t

    def pinned(self, t: torch.Tensor) -> torch.Tensor:
        out = self.pinned_empty(t.shape, t.dtype)
        return out.copy_(t)

    def is_pinned(self, t: torch.Tensor) -> bool:
        return not isinstance(t, FakeTensor) and t.untyped_storage().data_ptr() in self._pinned

    def generator(self, device: torch.device) -> torch.Generator:
        return torch.Generator()

    def graph_pool(self) -> None:
        return None

    def capture(self, fn: Callable[[], torch.Tensor], pool: Any) -> Replayed:
        """No graph on fake tensors: the captured function runs at every replay (what it runs is
        what a capture records, held to the same checks)."""
        self.captures += 1
        return Replayed(fn)

    def read(self, t: torch.Tensor) -> list[Any]:
        self.reads += 1
        t.to("cpu")  # the copy a real read makes (counted by CudaChecks as a host sync)
        return self.values(t)


def _devices(tensors: list[torch.Tensor]) -> set[str]:
    """Devices of the tensors that are not 0-d (a 0-d host tensor is a scalar argument)."""
    return {t.device.type for t in tensors if t.dim() > 0}


_COPIES = {aten.copy_, aten._to_copy, aten.to}  # under inference mode torch hands modes ``to``
# Under inference mode torch hands a mode ``item`` itself, not what it decomposes into.
_SCALAR_READS = {aten._local_scalar_dense.default, aten.item.default, aten.is_nonzero.default}


class CudaChecks(TorchDispatchMode):
    """Runs every operation touching CUDA on fake tensors, the rest for real; raises
    ``DeviceCheckError`` on mixed devices and scalar reads, and counts host syncs
    (``syncs``: device->host copies into pageable memory, plus the runtime's ``synchronize``)."""

    def __init__(self, runtime: FakeCuda) -> None:
        super().__init__()
        self.runtime = runtime
        self.fake = FakeTensorMode(allow_non_fake_inputs=True)
        self.pageable_reads = 0
        self.ops: Counter[str] = Counter()

    @property
    def syncs(self) -> int:
        return self.pageable_reads + self.runtime.synchronizes

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        leaves = tree_leaves((args, kwargs))
        tensors = [a for a in leaves if isinstance(a, torch.Tensor)]
        on_cuda = any(t.device.type == "cuda" for t in tensors) or any(
            isinstance(a, torch.device) and a.type == "cuda" for a in leaves
        )
        if func in _SCALAR_READS and on_cuda:
            raise DeviceCheckError(f"a scalar read of a CUDA tensor (a host sync):\n{_where()}")
        if func.overloadpacket in _COPIES:
            self._copy(func, args, kwargs)
        elif on_cuda and "cpu" in _devices(tensors):
            shapes = [(tuple(t.shape), str(t.device)) for t in tensors]
            raise DeviceCheckError(f"{func} mixes devices {shapes}:\n{_where()}")
        if not on_cuda and not any(isinstance(t, FakeTensor) for t in tensors):
            with unset_fake_temporarily():  # host work runs for real
                return func(*args, **kwargs)
        self.ops[str(func)] += 1
        # Host tensors as fakes of themselves: the fake mode would run an op on small real
        # inputs for real (constant propagation), on a CUDA no one has.
        args, kwargs = tree_map_only(torch.Tensor, self._fake, (args, kwargs))
        out = func(*args, **kwargs)  # to the fake mode beneath
        self.runtime.allocated(out)
        return out

    def __enter__(self) -> CudaChecks:
        # The fake mode beneath this one: torch skips initialising CUDA while one is active.
        self.fake.__enter__()
        self._host_pickles = ExitStack()
        for name in ("_object_to_tensor", "_tensor_to_object"):
            self._host_pickles.enter_context(patch.object(c10d, name, _real(getattr(c10d, name))))
        return super().__enter__()

    def __exit__(self, *exc: object) -> None:
        super().__exit__(*exc)
        self._host_pickles.close()
        self.fake.__exit__(*exc)

    def _fake(self, t: torch.Tensor) -> torch.Tensor:
        return t if isinstance(t, FakeTensor) else self.fake.from_tensor(t)

    def _copy(self, func: Any, args: tuple, kwargs: dict) -> None:
        if func.overloadpacket is aten.copy_:
            dst, src = args[0], args[1]
            blocking = not (args[2] if len(args) > 2 else kwargs.get("non_blocking", False))
            if src.device.type == "cuda" and dst.device.type == "cpu":
                if blocking or not self.runtime.is_pinned(dst):
                    self.pageable_reads += 1
        else:  # to, _to_copy: into a fresh tensor, never pinned
            src = args[0]
            device = kwargs.get("device", next((a for a in args[1:] if isinstance(a, torch.device)), None))
            if src.device.type == "cuda" and device is not None and torch.device(device).type == "cpu":
                self.pageable_reads += 1


def _real(fn: Callable[..., Any]) -> Callable[..., Any]:
    """``fn`` with no fake mode active. torch.distributed's object collectives (the control
    plane: rank 0's plan) pickle into host byte tensors, whose storage an active fake mode would
    make meta."""

    def host(*args: Any, **kwargs: Any) -> Any:
        with unset_fake_temporarily():
            return fn(*args, **kwargs)

    return host


def _where() -> str:
    frames = [f for f in traceback.extract_stack() if "/neo_rs/" in f.filename]
    return "".join(traceback.format_list(frames[-6:]))


def fake_rank(rank: int, size: int, env: dict[str, str], report: Connection) -> None:
    """A tensor-parallel worker process on a fake GPU of its own, as a launcher (``env://``)
    starts one: ``run_worker``, the production entry, under ``CudaChecks``. It reports its exit
    code and the host syncs of each iteration (swaps and forward; the start-up profile's timing
    waits aside); a failed check ends it with code 1 and a logged traceback."""
    os.environ.update(env)
    rt = FakeCuda()
    syncs: list[int] = []

    def counted(method: Callable[..., Any]) -> Callable[..., Any]:
        def run(*args: Any, **kwargs: Any) -> Any:
            before = checks.syncs
            out = method(*args, **kwargs)
            syncs.append(checks.syncs - before)
            return out

        return run

    with (
        use_runtime(rt),
        CudaChecks(rt) as checks,
        patch.object(ModelRunner, "apply_swaps", counted(ModelRunner.apply_swaps)),
        patch.object(ModelRunner, "execute", counted(ModelRunner.execute)),
    ):
        try:
            run_worker(rank, size, "env://")
        except SystemExit as e:
            report.send((e.code, syncs))
