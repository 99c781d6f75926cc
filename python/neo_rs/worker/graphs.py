"""Decode-only iterations replayed from CUDA graphs (vLLM's speed at small batches: one launch for
the whole forward instead of hundreds). An iteration qualifies when every row is a one-token
decode on the device pool and the plan moves no blocks during it: no prefill, no CPU decode, no
layer copies. Its batch is padded to a size bucket; each bucket has static device buffers (token
ids, positions, KV slots, block tables, lengths) and, from its first use on, a graph of the model's
forward up to the logits, captured from the runner's own layer loop (``ModelRunner.graph_forward``).
A replay copies the iteration's metadata into the buffers and launches the graph; sampling and
the CPU-attention hand-off stay outside it.

Padded rows are decodes of length 1 over a scratch block the scheduler never hands out: they
write their K/V there and attend to it, and their logits are dropped. Every block a row of the
batch may read is within its table, so the kernels need no knowledge of the padding. With several
KV groups (``kv/groups.py``) each group has its slots and tables in the buffers, and its batch.

On a CPU device the same buffers and the same loop run without a graph (``Replayed``): the CPU
tests hold a replayed iteration's tokens to the eager ones, which checks the padding and the
buffer updates that a GPU's replay depends on."""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any

import numpy as np
import torch

from neo_rs._core import SchedulerOutput
from neo_rs.attention.metadata import AttentionBatch, DecodeRows
from neo_rs.cuda_runtime import runtime
from neo_rs.kv.layer_copies import LayerCopies
from neo_rs.kv.pools import split_slots
from neo_rs.kv.transfer import HostTransfer

log = logging.getLogger(__name__)

MAX_GRAPH_BATCH = 256  # larger decode batches run eagerly (launches matter little there)


_SIZES = [1, 2, 4, *range(8, MAX_GRAPH_BATCH + 1, 8)]  # vLLM's: 1, 2, 4, then multiples of 8


def buckets(max_batch: int) -> list[int]:
    """Batch sizes with a graph of their own, the last the first to hold ``max_batch`` rows."""
    top = min(max_batch, MAX_GRAPH_BATCH)
    return [s for s in _SIZES if s < top] + [next(s for s in _SIZES if s >= top)]


class Replayed:
    """A graph's stand-in where there is none (a CPU device, or a fake GPU in tests): each replay
    runs the captured function again and writes its result into the output it first returned."""

    def __init__(self, fn: Callable[[], torch.Tensor]) -> None:
        self.fn = fn
        self.out = fn()

    def replay(self) -> None:
        self.out.copy_(self.fn())


@dataclass
class _Bucket:
    size: int
    ids: torch.Tensor
    positions: torch.Tensor
    slot_blocks: torch.Tensor  # [groups, size]
    slot_offsets: torch.Tensor  # [groups, size]
    tables: torch.Tensor  # [groups, size, width]
    lens: torch.Tensor
    batch: AttentionBatch
    graph: Any = None  # captured at the bucket's first iteration


# (token ids, positions, the batch's attention metadata) -> logits of every row
Forward = Callable[[torch.Tensor, torch.Tensor, AttentionBatch], torch.Tensor]


class DecodeGraphs:
    def __init__(
        self,
        forward: Forward,
        transfer: HostTransfer,
        block_size: int,
        max_batch: int,
        max_model_len: int,
        scratch_block: int,
        num_groups: int = 1,
    ) -> None:
        """Graphs of ``forward`` over decode iterations of up to ``max_batch`` rows;
        ``scratch_block``: a device block outside the scheduler's pool, for padded rows;
        ``num_groups``: the model's KV groups."""
        self.forward, self.transfer, self.device = forward, transfer, transfer.device
        self.num_groups = num_groups
        self.block_size, self.scratch, self.max_model_len = block_size, scratch_block, max_model_len
        self.width = -(-max_model_len // block_size)  # blocks a table can hold
        self.sizes = buckets(max_batch)
        self._buckets: dict[int, _Bucket] = {}
        self._pool = runtime().graph_pool() if self.device.type == "cuda" else None
        self.replays = 0

    def takes(self, plan: SchedulerOutput, copies: LayerCopies) -> bool:
        """Whether ``plan`` is a decode-only device iteration that fits a bucket."""
        n = len(plan.req_ids)
        return (
            0 < n <= self.sizes[-1]
            and plan.num_decodes == n
            and plan.num_cpu_decodes == 0
            and plan.sub_batch1_start == n
            and len(plan.input_ids) == n
            and copies.idle
        )

    def run(self, plan: SchedulerOutput) -> torch.Tensor:
        """The plan's logits, ``[rows, vocab]`` as ``compute_logits`` gives them (a view of the
        bucket's output: valid until the next replay)."""
        n = len(plan.req_ids)
        b = self._bucket(next(s for s in self.sizes if s >= n))
        self._fill(b, plan)
        if b.graph is None:
            b.graph = self._capture(b)
        b.graph.replay()
        self.replays += 1
        return b.graph.out[:n]

    def _bucket(self, size: int) -> _Bucket:
        if size not in self._buckets:
            dev = self.device

            def zeros(*shape: int, dtype: torch.dtype = torch.long) -> torch.Tensor:
                return torch.zeros(shape, dtype=dtype, device=dev)

            ids, positions, lens = zeros(size), zeros(size), zeros(size, dtype=torch.int32)
            g = self.num_groups
            blocks, offsets = zeros(g, size), zeros(g, size)
            tables = zeros(g, size, self.width, dtype=torch.int32)
            # On a pool in CPU memory the Rust kernel appends each row's K/V itself.
            appends = dev.type == "cpu"
            by_group = tuple(
                AttentionBatch(
                    tokens=slice(0, size),
                    device_writes=[] if appends else [(slice(0, size), (blocks[k], offsets[k]))],
                    host_writes=None,
                    gpu_decodes=DecodeRows(0, size, tables[k], lens, self.max_model_len, tables[k], lens, k),
                    cpu_decodes=DecodeRows(0, 0, tables[k, :0], lens[:0], 0, tables[k, :0], lens[:0], k),
                    prefills=[],
                    append_decodes=appends,
                )
                for k in range(g)
            )
            batch = replace(by_group[0], by_group=by_group) if g > 1 else by_group[0]
            self._buckets[size] = _Bucket(size, ids, positions, blocks, offsets, tables, lens, batch)
        return self._buckets[size]

    def _fill(self, b: _Bucket, plan: SchedulerOutput) -> None:
        """The iteration's metadata into the bucket's buffers; rows past it padded."""
        n, size, up = len(plan.req_ids), b.size, self.transfer.upload

        def padded(values: np.ndarray, pad: int, dtype: Any = np.int64) -> torch.Tensor:
            out = np.full(size, pad, dtype=dtype)
            out[:n] = values
            return up(torch.from_numpy(out))

        b.ids.copy_(padded(plan.input_ids, 0))
        b.positions.copy_(padded(plan.positions, 0))
        b.lens.copy_(padded(plan.seq_lens, 1, np.int32))
        for k in range(self.num_groups):
            blocks, offsets = split_slots(plan.slot_mapping[k], self.block_size)
            b.slot_blocks[k].copy_(padded(blocks.numpy(), self.scratch))
            b.slot_offsets[k].copy_(padded(offsets.numpy(), 0))
        tables = np.full((self.num_groups, size, self.width), self.scratch, dtype=np.int32)
        tables[:, :n, : plan.block_tables.shape[2]] = plan.block_tables
        b.tables.copy_(up(torch.from_numpy(tables)))

    def _capture(self, b: _Bucket) -> Any:
        def forward() -> torch.Tensor:
            return self.forward(b.ids, b.positions, b.batch)

        if self.device.type != "cuda":
            return Replayed(forward)
        log.info("capturing a CUDA graph of decode iterations of %d rows", b.size)
        return runtime().capture(forward, self._pool)
