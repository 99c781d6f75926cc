"""The copies of a plan that run inside the forward, layer by layer, with the first sub-batch's
pre stage: each layer's share leaves (or arrives) while the layers before it compute, and no copy
of every layer at once holds the device stream or a device buffer of that size. (Where copies are
synchronous, on a CPU device without the async-copy emulation, those before the writes go at once,
at layer 0.)

Layers that share a pool slot (``kv/groups.py``: a layer of each KV group) share its copies: they
go before the slot's first writer, or after its last.

Before layer ``i``'s KV writes:
- device blocks evicted from the prefix cache are gathered into the host tier (``cache_to_host``).
  The plan has handed their ids out again, so the gather must come before anything writes layer
  ``i`` of them: this iteration's KV writes and the copies into the device below.
- swap-ins and host-tier hits (``swap_in``, ``cache_to_device``) reach their device blocks. They
  were gathered on the host when the copies were made, before any host block could change.

After them: finishing host-bound prefills leave their staged device blocks (``prefill_to_host``).

Copies into the host pool land at ``ready()`` of what ``landing`` collects, which the runner
reaches after the forward (nothing reads those host blocks before the next plan)."""

from __future__ import annotations

import numpy as np
import torch

from neo_rs._core import SchedulerOutput
from neo_rs.kv.groups import KvGroups
from neo_rs.kv.pools import KvPool, block_pairs
from neo_rs.kv.transfer import HostTransfer, Staged


class LayerCopies:
    def __init__(
        self,
        transfer: HostTransfer,
        dev: KvPool,
        host: KvPool,
        groups: KvGroups,
        *,
        demote: np.ndarray,
        incoming: np.ndarray,
        staged: np.ndarray,
    ) -> None:
        """Block pairs ``[n, 2]`` (source, destination): ``demote`` device to host tier,
        ``incoming`` host to device, ``staged`` host-bound prefills' device blocks to the host."""
        self.transfer, self.dev, self.host, self.groups = transfer, dev, host, groups
        self.landing: list[Staged] = []
        self._demote = block_pairs(demote, dev, host) if len(demote) else None
        self._staged = block_pairs(staged, dev, host) if len(staged) else None
        self._to_device: tuple[list[torch.Tensor], torch.Tensor] | None = None
        if len(incoming):
            src, dst = block_pairs(incoming, host, dev)
            self._to_device = transfer.gather_from_host(host, src), dst

    @classmethod
    def of_plan(
        cls, plan: SchedulerOutput, transfer: HostTransfer, dev: KvPool, host: KvPool, groups: KvGroups
    ) -> LayerCopies:
        incoming = np.concatenate([plan.swap_in, plan.cache_to_device])
        return cls(
            transfer,
            dev,
            host,
            groups,
            demote=plan.cache_to_host,
            incoming=incoming,
            staged=plan.prefill_to_host,
        )

    @property
    def idle(self) -> bool:
        """Whether the plan moves no blocks between the pools during its layers."""
        return self._demote is None and self._staged is None and self._to_device is None

    def before_writes(self, layer: int) -> None:
        # Synchronous copies (a CPU device) gain nothing from the split: every layer goes at
        # layer 0, still before any write, in a few large copies rather than many small ones.
        at: int | None = self.groups.slot[layer]
        if not self.transfer.overlaps:
            if layer > 0:
                return
            at = None
        elif not self.groups.first_writer(layer):
            return
        with self.transfer.unpriced():
            if self._demote is not None:
                self.landing.append(self.transfer.blocks_to_host(self.dev, self.host, self._demote, at))
            if self._to_device is not None:
                gathered, blocks = self._to_device
                self.transfer.layer_to_device(gathered, self.dev, blocks, at)

    def after_writes(self, layer: int) -> None:
        if self._staged is not None and self.groups.last_writer(layer):
            slot = self.groups.slot[layer]
            self.landing.append(self.transfer.blocks_to_host(self.dev, self.host, self._staged, slot))
