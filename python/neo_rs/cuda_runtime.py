"""Everything the engine asks of CUDA besides tensor operations, in one place: whether a GPU is
there and what it is, its free memory, streams and events, pinned host memory, device random
generators, and the one read of device values the host waits for each iteration (the sampled
tokens). Tensor operations go through torch as they are.

This is the seam that lets the CUDA path run on a machine without a GPU: under
``FakeTensorMode`` torch makes ``device="cuda"`` tensors of metadata only, and a test installs
its own ``CudaRuntime`` (``use_runtime``) that answers these calls without a driver. The engine
code that runs is the code a GPU runs; only what lies behind this class differs."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager
from typing import Any

import torch


class CudaRuntime:
    """The real one: torch.cuda. A stand-in overrides every method."""

    def available(self) -> bool:
        return torch.cuda.is_available()

    def capability(self, device: torch.device) -> tuple[int, int]:
        return torch.cuda.get_device_capability(device)

    def device_name(self, device: torch.device) -> str:
        return torch.cuda.get_device_name(device)

    def mem_get_info(self, device: torch.device) -> tuple[int, int]:
        """Free and total bytes of the device."""
        return torch.cuda.mem_get_info(device)

    def set_device(self, device: torch.device) -> None:
        torch.cuda.set_device(device)

    def synchronize(self, device: torch.device | None = None) -> None:
        torch.cuda.synchronize(device)

    def collective_backend(self) -> str:
        """The torch.distributed backend of the tensor-parallel ranks' device collectives."""
        return "nccl"

    def empty_cache(self) -> None:
        torch.cuda.empty_cache()

    def new_stream(self, device: torch.device) -> Any:
        return torch.cuda.Stream(device)

    def on_stream(self, stream: Any) -> AbstractContextManager[Any]:
        return torch.cuda.stream(stream)

    def new_event(self, enable_timing: bool = False) -> Any:
        return torch.cuda.Event(enable_timing=enable_timing)

    def record_stream(self, t: torch.Tensor, stream: Any) -> None:
        """``t``'s memory is not reused until ``stream``'s work queued so far is done."""
        t.record_stream(stream)

    def pinned_empty(self, shape: tuple[int, ...] | torch.Size, dtype: torch.dtype) -> torch.Tensor:
        """Page-locked host memory (from torch's caching host allocator), which the device copies
        from and into asynchronously."""
        return torch.empty(shape, dtype=dtype, pin_memory=True)

    def pinned(self, t: torch.Tensor) -> torch.Tensor:
        """A page-locked copy of host tensor ``t``."""
        return t.pin_memory()

    def generator(self, device: torch.device) -> torch.Generator:
        return torch.Generator(device)

    def graph_pool(self) -> Any:
        """A memory pool CUDA graphs share (they replay one at a time)."""
        return torch.cuda.graph_pool_handle()

    def capture(self, fn: Callable[[], torch.Tensor], pool: Any) -> Any:
        """A CUDA graph of ``fn``'s device work, from a warm-up run on a side stream first (Triton
        compiles and cuBLAS picks its kernels outside the capture). The result has ``replay()``,
        and ``out``: ``fn``'s output tensor, which every replay rewrites."""
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            fn()
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=pool):
            out = fn()
        return _Graph(graph, out)

    def read(self, t: torch.Tensor) -> list[Any]:
        """The values of device tensor ``t`` on the host (``tolist``). The host waits for the
        device here: the engine's one planned wait of an iteration, for the sampled tokens."""
        return t.tolist()


class _Graph:
    def __init__(self, graph: torch.cuda.CUDAGraph, out: torch.Tensor) -> None:
        self.graph, self.out = graph, out

    def replay(self) -> None:
        self.graph.replay()


_current = CudaRuntime()


def runtime() -> CudaRuntime:
    """The runtime in use: torch.cuda's, unless a test has installed a stand-in."""
    return _current


@contextmanager
def use_runtime(rt: CudaRuntime) -> Iterator[CudaRuntime]:
    """Install ``rt`` for the block (tests: a GPU stand-in under ``FakeTensorMode``)."""
    global _current
    previous, _current = _current, rt
    try:
        yield rt
    finally:
        _current = previous
