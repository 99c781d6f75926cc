"""Every device<->host copy of the engine goes through ``HostTransfer``: CPU decodes' q/k/v and
attention outputs, whole-request swaps between the KV pools, host-bound prefill rows and
staged blocks. On CUDA it uses pinned host buffers and a copy stream with events, so copies
overlap compute and the host waits only for the copy it needs. On a CPU device copies are plain
and synchronous, unless ``NEO_RS_EMULATE_ASYNC_COPIES=1``: then each device->host copy is
deferred until the host waits on it, and until then its destination holds poison (NaN, or a
sentinel for integers), as a CUDA destination would hold stale bytes. Reading a destination
before its wait is the bug class this makes visible to the CPU-only tests."""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager, nullcontext
from dataclasses import dataclass, field

import torch

from neo_rs.cuda_runtime import runtime
from neo_rs.kv.pools import KvPool, Slots
from neo_rs.timing import HostWaits, StageClock

CPU = torch.device("cpu")
INT_POISON = -0x5A5A5A5A  # what an integer destination holds until its copy lands

Pairs = tuple[torch.Tensor, torch.Tensor]  # (source, destination) block indices
Landing = Callable[[list[torch.Tensor]], None]  # host work that needs the landed tensors


@dataclass
class Staged:
    """Host tensors being filled. ``ready()`` waits until the copies have landed, then runs the
    host work that needed them (``then``, e.g. a scatter into the host pool) once."""

    tensors: list[torch.Tensor]
    wait: Callable[[], None] | None = None
    then: Landing | None = None
    _done: bool = field(default=False, repr=False)

    def ready(self) -> list[torch.Tensor]:
        if not self._done:
            if self.wait is not None:
                self.wait()
            if self.then is not None:
                self.then(self.tensors)
            self._done = True
        return self.tensors

    @property
    def immediate(self) -> bool:
        """Whether the bytes are already on the host (no copy in flight)."""
        return self.wait is None


def poison(t: torch.Tensor) -> torch.Tensor:
    """``t`` filled with what an unlanded copy leaves behind."""
    return t.fill_(float("nan") if t.is_floating_point() else INT_POISON)


class _EmulatedCopyStream:
    """CUDA's copy stream, played on the CPU: copies run in order, each when a wait reaches it."""

    def __init__(self) -> None:
        self._queue: deque[tuple[int, Callable[[], None]]] = deque()
        self._issued = 0

    def enqueue(self, copy: Callable[[], None]) -> int:
        self._issued += 1
        self._queue.append((self._issued, copy))
        return self._issued

    def run_until(self, ticket: int) -> None:
        while self._queue and self._queue[0][0] <= ticket:
            self._queue.popleft()[1]()


class HostTransfer:
    def __init__(self, device: torch.device, emulate_async: bool = False) -> None:
        self.device = device
        self.cuda = runtime()
        self.stream = self.cuda.new_stream(device) if device.type == "cuda" else None
        self.emulated = _EmulatedCopyStream() if emulate_async and self.stream is None else None
        self.waits = HostWaits()  # the runner hands each iteration its own
        # The iteration's clock, which times its copies as the "copy" stage (the predictor's
        # transfer term); None between iterations (swaps are not priced by the plan).
        self.clock: StageClock | None = None

    def _timed(self, stream: torch.cuda.Stream | None = None) -> AbstractContextManager[None]:
        return nullcontext() if self.clock is None else self.clock.span("copy", stream)

    @contextmanager
    def unpriced(self) -> Iterator[None]:
        """Copies the plan's stage times do not price (the prefix cache's and swaps), kept off the
        iteration's clock so that they do not skew the predictor's transfer term."""
        clock, self.clock = self.clock, None
        try:
            yield
        finally:
            self.clock = clock

    @property
    def overlaps(self) -> bool:
        """Whether copies run beside compute (CUDA's copy stream, or its emulation), so that a
        plan's copies pay to be issued layer by layer; otherwise each is synchronous."""
        return self.stream is not None or self.emulated is not None

    @property
    def pinned(self) -> bool:
        return self.stream is not None

    def to_host(self, *tensors: torch.Tensor, then: Landing | None = None) -> Staged:
        """Start copying device tensors into fresh host buffers (same dtype). The device work that
        produced them is ordered before the copies; ``then`` runs at ``ready()``."""
        if self.stream is not None:
            cuda = self.cuda
            produced = cuda.new_event()
            produced.record()
            outs = []
            with cuda.on_stream(self.stream):
                self.stream.wait_event(produced)
                with self._timed(self.stream):
                    for t in tensors:
                        host = cuda.pinned_empty(t.shape, t.dtype)
                        host.copy_(t, non_blocking=True)
                        cuda.record_stream(t, self.stream)
                        outs.append(host)
            done = cuda.new_event()
            done.record(self.stream)
            return Staged(outs, lambda: self.waits.for_copy(done.synchronize), then)
        if self.emulated is not None:
            outs = [poison(torch.empty(t.shape, dtype=t.dtype)) for t in tensors]
            srcs, timed = list(tensors), self._timed()

            def copy() -> None:
                with timed:
                    for dst, src in zip(outs, srcs, strict=True):
                        dst.copy_(src)

            ticket, stream = self.emulated.enqueue(copy), self.emulated
            return Staged(outs, lambda: self.waits.for_copy(lambda: stream.run_until(ticket)), then)
        with self._timed():
            return Staged([t.to(CPU).contiguous() for t in tensors], None, then)

    def upload(self, t: torch.Tensor) -> torch.Tensor:
        """Per-iteration metadata (token ids, block tables, slots) onto the device without making
        the host wait: from pinned memory, queued on the device's stream. A plain ``.to(cuda)``
        of pageable memory synchronises the stream."""
        if self.stream is None:
            return t.to(self.device)
        return self.cuda.pinned(t).to(self.device, non_blocking=True)

    def host_buffer(self, like: torch.Tensor) -> torch.Tensor:
        """A host buffer like ``like`` that ``to_device`` can copy from asynchronously (the CPU
        kernel's outputs, blocks gathered for the device)."""
        return self._host_empty(like.shape, like.dtype)

    def _host_empty(self, shape: tuple[int, ...] | torch.Size, dtype: torch.dtype) -> torch.Tensor:
        return self.cuda.pinned_empty(shape, dtype) if self.pinned else torch.empty(shape, dtype=dtype)

    def to_device(self, t: torch.Tensor) -> torch.Tensor:
        """A host tensor onto the device, queued on the device's own stream (so ordered before
        every later kernel that reads it; pinned sources make it asynchronous)."""
        with self._timed():
            return t.to(self.device, non_blocking=self.pinned)

    def blocks_to_host(self, src: KvPool, dst: KvPool, pairs: Pairs, layer: int | None = None) -> Staged:
        """Copy K and V of device blocks ``pairs[0]`` into host blocks ``pairs[1]``: one layer, or
        every layer when None. The gather runs now, in the device's order, so writes that reuse
        the source blocks later in the iteration cannot race it; the bytes reach the host pool at
        ``ready()``, which the caller must reach before anything reads those host blocks."""
        src_idx, dst_idx = pairs
        at = (slice(None), src_idx) if layer is None else (layer, src_idx)
        into = (slice(None), dst_idx) if layer is None else (layer, dst_idx)

        def scatter(landed: list[torch.Tensor]) -> None:
            dst.store_blocks(into, *landed)

        if self.emulated is not None:  # the host blocks are not whole until ready()
            dst.poison_blocks(into)
        return self.to_host(src.k[at], src.v[at], then=scatter)

    def rows_to_host(self, dst: KvPool, layer: int, slots: Slots, k: torch.Tensor, v: torch.Tensor) -> Staged:
        """Copy device rows of K and V (``[tokens, kv_heads, head_dim]``) into host-pool slots of
        one layer; they are there at ``ready()``."""

        def write(landed: list[torch.Tensor]) -> None:
            dst.write(layer, slots, landed[0], landed[1])

        if self.emulated is not None:
            dst.poison_slots(layer, slots)
        return self.to_host(k, v, then=write)

    def gather_from_host(self, src: KvPool, block_ids: torch.Tensor) -> list[torch.Tensor]:
        """K and V (every layer) of host blocks ``block_ids``, gathered (and dequantized, from an
        int8 pool) on the host now, into buffers ``layer_to_device`` copies from asynchronously:
        K's and V's, or from a pool of tile pairs (``KvPool.tile_pairs``) one buffer of pairs,
        split on the device (gathering the pool's halves takes torch's strided path, 10x slower,
        and the halves of a gathered buffer would reach the device unpinned)."""
        if src.quantized:
            return [self.host_buffer(x).copy_(x) for x in src.load_blocks(block_ids)]
        out = []
        for s in (src.k, src.v) if src.tile_pairs is None else (src.tile_pairs,):
            shape = (s.shape[0], len(block_ids), *s.shape[2:])
            gathered = self._host_empty(shape, s.dtype)
            out.append(torch.index_select(s, 1, block_ids, out=gathered))
        return out

    def layer_to_device(
        self, gathered: list[torch.Tensor], dst: KvPool, block_ids: torch.Tensor, layer: int | None = None
    ) -> None:
        """Layer ``layer`` (every layer when None) of ``gather_from_host``'s K and V into device
        blocks ``block_ids``, copied on the device's stream (so before every later kernel)."""
        at = slice(None) if layer is None else layer
        parts = [self.to_device(g[at]) for g in gathered]
        if len(parts) == 1:  # tile pairs: K and V are the halves of dim -3
            parts = [parts[0].select(-3, 0), parts[0].select(-3, 1)]
        dst.store_blocks((at, block_ids), *parts)
