"""Stage timing for the perf predictor's online correction and the iteration stats (wall clock
on a CPU device, CUDA events on a GPU, read with one wait at the end of the forward), and the
one counted place where an iteration makes the host wait for the device."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch


@dataclass
class HostWaits:
    """Every wait of the host for the device in one iteration, counted so tests can hold them to
    a constant: ``device``, for the compute stream (stage timers, read once at the end), and
    ``copies``, for a device->host copy whose bytes the host is about to read."""

    device: int = 0
    copies: int = 0

    def for_device(self, event: torch.cuda.Event | None) -> None:
        self.device += 1
        if event is not None:
            event.synchronize()

    def for_copy(self, wait: Callable[[], None]) -> None:
        self.copies += 1
        wait()


class StageClock:
    """Marks points in the issue order of device work; after ``settle()``, ``span_ms(a, b)`` is
    the time between marks ``a`` and ``b`` as the device executed them."""

    def __init__(self, device: torch.device, waits: HostWaits) -> None:
        self.cuda = device.type == "cuda"
        self.waits = waits
        self.marks: list[float | torch.cuda.Event] = []

    def mark(self) -> int:
        if self.cuda:
            e = torch.cuda.Event(enable_timing=True)
            e.record()
            self.marks.append(e)
        else:
            self.marks.append(time.perf_counter())
        return len(self.marks) - 1

    def settle(self) -> None:
        """Wait once for the device to pass the last mark (every span is readable then)."""
        last = self.marks[-1] if self.marks else None
        self.waits.for_device(last if isinstance(last, torch.cuda.Event) else None)

    def span_ms(self, a: int, b: int) -> float:
        start, end = self.marks[a], self.marks[b]
        if isinstance(start, torch.cuda.Event) and isinstance(end, torch.cuda.Event):
            return float(start.elapsed_time(end))
        assert isinstance(start, float) and isinstance(end, float)
        return (end - start) * 1e3


@dataclass
class MeasuredTimes:
    """Measured per-layer means (ms) of one iteration; None where the stage was not isolated
    (the pipeline overlaps device stages, so only its CPU kernels are timed)."""

    linear_ms: float | None = None
    device_attn_ms: float | None = None
    cpu_attn_ms: list[float] = field(default_factory=list)  # kernel run time, per layer and sub-batch
    cpu_wait_ms: float = 0.0  # of that, how long the host sat waiting for it (not hidden)
    transfer_bytes: int = 0
    waits: HostWaits = field(default_factory=HostWaits)

    def cpu_attn_per_layer(self, num_layers: int) -> float:
        return sum(self.cpu_attn_ms) / num_layers
