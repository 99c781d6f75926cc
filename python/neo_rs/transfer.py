"""Device<->host copies of CPU decodes' q/k/v and attention outputs, behind one interface. On
CUDA: pinned staging buffers and a copy stream with events, so copies overlap compute and the
host waits only for the copy it needs; on a CPU device the "copies" are plain contiguous views
(the same code path, exercised by the tests)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

CPU = torch.device("cpu")


@dataclass
class Staged:
    """Host tensors being filled; ``ready()`` blocks until the copies have landed."""

    tensors: list[torch.Tensor]
    event: torch.cuda.Event | None = None

    def ready(self) -> list[torch.Tensor]:
        if self.event is not None:
            self.event.synchronize()
        return self.tensors

    @property
    def immediate(self) -> bool:
        return self.event is None


class HostTransfer:
    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.stream = torch.cuda.Stream(device) if device.type == "cuda" else None

    def to_host(self, *tensors: torch.Tensor) -> Staged:
        """Start copying device tensors into contiguous host memory (model dtype)."""
        if self.stream is None:
            return Staged([t.to(CPU).contiguous() for t in tensors])
        produced = torch.cuda.Event()
        produced.record()
        outs = []
        with torch.cuda.stream(self.stream):
            self.stream.wait_event(produced)
            for t in tensors:
                host = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
                host.copy_(t, non_blocking=True)
                t.record_stream(self.stream)
                outs.append(host)
        done = torch.cuda.Event()
        done.record(self.stream)
        return Staged(outs, done)

    def host_buffer(self, like: torch.Tensor) -> torch.Tensor:
        """An output buffer the CPU kernel writes and ``to_device`` can copy asynchronously."""
        return torch.empty(like.shape, dtype=like.dtype, pin_memory=self.stream is not None)

    def to_device(self, t: torch.Tensor) -> torch.Tensor:
        return t.to(self.device, non_blocking=self.stream is not None)
