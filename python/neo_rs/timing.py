"""Stage timing for the perf predictor's online correction and the iteration stats (wall clock
on a CPU device, CUDA events on a GPU, read once the iteration's tokens are sampled), and the
one counted place where an iteration makes the host wait for the device."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

import torch

from neo_rs.cuda_runtime import runtime


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
    """Times the device work of each stage, by term: ``span(term)`` around the work as it is
    issued, on the device's stream or another (the copy stream). After ``settle()``,
    ``total_ms(term)`` is the summed execution time of its spans, as the device ran them."""

    def __init__(self, device: torch.device, waits: HostWaits, timed: bool = True) -> None:
        """``timed=False``: spans time nothing (a CUDA graph's capture records no events)."""
        self.timed = timed
        self.cuda = device.type == "cuda"
        self.waits = waits
        self._events: dict[str, list[tuple[torch.cuda.Event, torch.cuda.Event]]] = {}
        self._wall_ms: dict[str, float] = {}  # on a CPU device the work runs as it is issued
        self._last: torch.cuda.Event | None = None

    def _event(self, stream: torch.cuda.Stream | None) -> torch.cuda.Event:
        e = runtime().new_event(enable_timing=True)
        e.record(stream)
        if stream is None:
            self._last = e
        return e

    @contextmanager
    def span(self, term: str, stream: torch.cuda.Stream | None = None) -> Iterator[None]:
        if not self.timed:
            yield
        elif self.cuda:
            start = self._event(stream)
            yield
            self._events.setdefault(term, []).append((start, self._event(stream)))
        else:
            t = time.perf_counter()
            yield
            self._wall_ms[term] = self._wall_ms.get(term, 0.0) + (time.perf_counter() - t) * 1e3

    def record_ms(self, term: str, ms: float) -> None:
        """Add ``ms`` of CPU-device work to ``term``, timed by the caller (work that runs inside
        a compiled graph, where no span can sit)."""
        assert not self.cuda, "CUDA work is timed by events"
        if self.timed:
            self._wall_ms[term] = self._wall_ms.get(term, 0.0) + ms

    def settle(self) -> None:
        """Wait once for the device to pass the last mark on its stream (the engine calls this
        after reading the sampled tokens, so the device is already there)."""
        self.waits.for_device(self._last)

    def total_ms(self, term: str) -> float | None:
        """None when no span of ``term`` ran."""
        if term in self._events:
            return sum(float(a.elapsed_time(b)) for a, b in self._events[term])
        return self._wall_ms.get(term)


# The terms ``StageClock`` times, as the predictor names them: linear layers (both sub-batches),
# device attention of prefill chunks and of decodes, and the priced host<->device copies (CPU
# decodes' rows and outputs, host-bound prefill KV).
TIMED_TERMS = ("linear", "prefill_attn", "gpu_decode", "copy")


@dataclass
class MeasuredTimes:
    """What one iteration measured. Device stages are timed in every mode: in the pipeline they
    overlap the CPU kernels, which is the time the predictor has to foresee there."""

    clock: StageClock | None = None
    cpu_attn_ms: list[float] = field(default_factory=list)  # kernel run time, per layer and sub-batch
    cpu_wait_ms: float = 0.0  # of that, how long the host sat waiting for it (not hidden)
    transfer_bytes: int = 0
    waits: HostWaits = field(default_factory=HostWaits)
    _layer_ms: dict[str, float] = field(default_factory=dict)

    def settle(self, num_layers: int) -> dict[str, float]:
        """Per-layer means (ms) of every stage that ran (``TIMED_TERMS`` and ``cpu_attn``), read
        from the clock once."""
        if self.clock is not None:
            self.clock.settle()
            for term in TIMED_TERMS:
                total = self.clock.total_ms(term)
                if total is not None:
                    self._layer_ms[term] = total / num_layers
            self.clock = None
        if self.cpu_attn_ms:
            self._layer_ms["cpu_attn"] = sum(self.cpu_attn_ms) / num_layers
        return self._layer_ms
