"""Stage timing for the perf predictor's online correction and the iteration stats: wall
clock on a CPU device, CUDA events on a GPU (read after the iteration's own sync)."""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch


class StageClock:
    """Marks points in the issue order of device work; ``span_ms(a, b)`` is the time between
    marks ``a`` and ``b`` as the device executed them."""

    def __init__(self, device: torch.device) -> None:
        self.cuda = device.type == "cuda"
        self.marks: list[float | torch.cuda.Event] = []

    def mark(self) -> int:
        if self.cuda:
            e = torch.cuda.Event(enable_timing=True)
            e.record()
            self.marks.append(e)
        else:
            self.marks.append(time.perf_counter())
        return len(self.marks) - 1

    def span_ms(self, a: int, b: int) -> float:
        start, end = self.marks[a], self.marks[b]
        if isinstance(start, torch.cuda.Event) and isinstance(end, torch.cuda.Event):
            end.synchronize()
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
    transfer_bytes: int = 0

    def cpu_attn_per_layer(self, num_layers: int) -> float:
        return sum(self.cpu_attn_ms) / num_layers
