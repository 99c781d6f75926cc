"""Attention over the paged KV pools for one iteration: prefill chunks with torch SDPA (causal,
per sequence); device decodes with the Rust CPU kernel when the device pool is in CPU memory,
else a CUDA backend (``device_decode.py``: FlashInfer, our Triton kernel, or plain torch); CPU
decodes (NEO's offloaded requests) with the Rust kernel over the host pool, appending their new
K/V there."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F

from neo_rs._core import AttentionHandle, CpuAttention, SchedulerOutput
from neo_rs.device_decode import select_device_decode, select_paged_prefill
from neo_rs.kv_cache import KvPool, Slots, split_slots
from neo_rs.timing import StageClock
from neo_rs.transfer import HostTransfer, Staged


@dataclass
class Prefill:
    """Rows ``start:end`` of the batch: positions ``num_computed .. seq_len`` of one sequence."""

    start: int
    end: int
    num_computed: int
    seq_len: int
    block_table: torch.Tensor  # int64 block ids covering seq_len


@dataclass
class DecodeRows:
    """Rows ``start:end`` of the batch: one-token decodes over one pool."""

    start: int
    end: int
    block_tables: torch.Tensor  # [rows, max_blocks] int32, on the pool's device
    seq_lens: torch.Tensor  # [rows] int32, on the pool's device
    max_seq_len: int  # known on the host, so kernels plan their splits without a device sync
    # The same tables and lengths in CPU memory, for backends that plan on the host.
    host_tables: torch.Tensor
    host_lens: torch.Tensor

    def __len__(self) -> int:
        return self.end - self.start


@dataclass
class AttentionBatch:
    """The per-iteration metadata every layer's attention shares, for one sub-batch. Rows: GPU
    decodes, CPU attention (decodes, and prompts decoded in place over host-tier blocks, a row
    per token), device prefill chunks, host prefills."""

    tokens: slice  # this sub-batch's rows of the whole batch
    device_writes: list[tuple[slice, Slots]]  # rows whose K/V go to the device pool
    host_writes: tuple[slice, Slots] | None  # whole prompts whose K/V go to the host pool
    gpu_decodes: DecodeRows  # tables on the device
    cpu_decodes: DecodeRows  # tables in CPU memory (the host pool's), a row per token
    prefills: list[Prefill]
    # The GPU decodes' K/V is appended by the decode kernel (not in ``device_writes``).
    append_decodes: bool = False

    @staticmethod
    def from_plan(plan: SchedulerOutput, transfer: HostTransfer, block_size: int) -> list[AttentionBatch]:
        """One batch per sub-batch of the plan (two when it is pipelined); each batch's rows
        count from its own first token."""
        n, s1 = len(plan.req_ids), plan.sub_batch1_start
        nd, ncd, nhp = plan.num_decodes, plan.num_cpu_decodes, plan.num_host_prefills
        batches = [AttentionBatch._rows(plan, 0, s1, (nd, ncd, nhp), transfer, block_size)]
        if s1 < n:
            batches.append(AttentionBatch._rows(plan, s1, n, (n - s1, n - s1, 0), transfer, block_size))
        return batches

    @staticmethod
    def _rows(
        plan: SchedulerOutput,
        lo: int,
        hi: int,
        counts: tuple[int, int, int],
        transfer: HostTransfer,
        block_size: int,
    ) -> AttentionBatch:
        """Requests ``lo:hi``; ``counts``: their decodes, CPU decodes among them, host prefills.
        Everything the device reads is uploaded here, once per iteration, not per layer."""
        up = transfer.upload

        def up_slots(rows: slice) -> Slots:
            block, offset = split_slots(slots[rows], block_size)
            return up(block), up(offset)

        nd, ncd, nhp = counts
        ngd = nd - ncd
        qsl = plan.query_start_loc[lo : hi + 1] - plan.query_start_loc[lo]
        lens = plan.seq_lens[lo:hi]
        tables = torch.from_numpy(plan.block_tables[lo:hi])
        seq_lens = torch.from_numpy(lens)
        prefills = []
        for i in range(nd, hi - lo):
            nblocks = -(-int(lens[i]) // block_size)
            start, end = int(qsl[i]), int(qsl[i + 1])
            seq_len = int(lens[i])
            prefills.append(
                Prefill(start, end, seq_len - (end - start), seq_len, up(tables[i, :nblocks].long()))
            )
        t0, t1 = int(plan.query_start_loc[lo]), int(plan.query_start_loc[hi])
        slots = plan.slot_mapping[t0:t1]
        # Rows: GPU decodes, CPU attention (the kernel appends their K/V), device prefills, then
        # host prefills (the last rows). Slots are split once here, not once per layer.
        cpu_start, cpu_end, host = int(qsl[ngd]), int(qsl[nd]), int(qsl[hi - lo - nhp])
        # A device pool in CPU memory: the Rust kernel appends the GPU decodes' K/V itself, unless
        # blocks are staged to the host pool (copied in each layer's pre stage, after its writes).
        append_decodes = transfer.device.type == "cpu" and not len(plan.prefill_to_host)
        decodes_written = 0 if append_decodes else cpu_start
        cpu_tables, cpu_lens = tables[ngd:nd], seq_lens[ngd:nd]
        if cpu_end - cpu_start > nd - ngd:
            # A prompt decoded in place over host blocks has several rows: each attends as a
            # decode at its own position, over its request's table.
            cpu_tables = cpu_tables.repeat_interleave(torch.from_numpy(np.diff(qsl[ngd : nd + 1])), dim=0)
            cpu_lens = torch.from_numpy(plan.positions[t0 + cpu_start : t0 + cpu_end] + 1).to(torch.int32)
        to_device = [r for r in (slice(0, decodes_written), slice(cpu_end, host)) if r.stop > r.start]
        host_rows = slice(host, t1 - t0)
        return AttentionBatch(
            tokens=slice(t0, t1),
            device_writes=[(r, up_slots(r)) for r in to_device],
            host_writes=(host_rows, split_slots(slots[host_rows], block_size))
            if host_rows.stop > host_rows.start
            else None,
            gpu_decodes=DecodeRows(
                0,
                ngd,
                up(tables[:ngd]),
                up(seq_lens[:ngd]),
                int(lens[:ngd].max(initial=0)),
                tables[:ngd],
                seq_lens[:ngd],
            ),
            cpu_decodes=DecodeRows(
                cpu_start,
                cpu_end,
                cpu_tables,
                cpu_lens,
                int(lens[ngd:nd].max(initial=0)),
                cpu_tables,
                cpu_lens,
            ),
            prefills=prefills,
            append_decodes=append_decodes,
        )


class PendingCpuAttention:
    """CPU attention submitted to the Rust pool; ``result()`` waits (GIL released) and sends
    the output back to the model's device."""

    def __init__(self, handle: AttentionHandle, out: torch.Tensor, transfer: HostTransfer) -> None:
        self.handle, self.out, self.transfer = handle, out, transfer

    def result(self) -> torch.Tensor:
        self.handle.wait()
        return self.transfer.to_device(self.out)


class Attention:
    """One layer's attention for one sub-batch. ``cpu_attention`` serves CPU decodes, and device
    decodes too when the device pool lives in CPU memory."""

    def __init__(self, scale: float, cpu_attention: CpuAttention, transfer: HostTransfer) -> None:
        self.scale = scale
        self.cpu_attention = cpu_attention
        self.transfer = transfer
        cuda = transfer.device.type == "cuda"
        self.device_decode = select_device_decode(transfer.device) if cuda else None
        self.paged_prefill = select_paged_prefill() if cuda else None

    def decode(
        self,
        q: torch.Tensor,
        pool: KvPool,
        layer: int,
        rows: DecodeRows,
        out: torch.Tensor,
        new_kv: tuple[torch.Tensor, torch.Tensor] | None = None,
    ) -> None:
        """Device-pool decodes into ``out``: their K/V already written, or ``new_kv`` to append
        first (a pool in CPU memory only: the Rust kernel appends and attends in one call)."""
        if pool.device.type == "cpu":
            new_k, new_v = (t.contiguous() for t in new_kv) if new_kv is not None else (None, None)
            self.cpu_attention.forward(
                q.contiguous(),
                pool.k,
                pool.v,
                layer,
                rows.block_tables,
                rows.seq_lens,
                self.scale,
                out,
                new_k=new_k,
                new_v=new_v,
            )
            return
        assert new_kv is None and self.device_decode is not None, "a CUDA pool: a device backend, no append"
        self.device_decode(q, pool, layer, rows, self.scale, out)

    def stage_cpu(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, batch: AttentionBatch
    ) -> Staged | None:
        """Start moving the batch's CPU-decode rows of q/k/v to the host (model dtype)."""
        c = batch.cpu_decodes
        if not len(c):
            return None
        return self.transfer.to_host(q[c.start : c.end], k[c.start : c.end], v[c.start : c.end])

    def submit_cpu(
        self, staged: Staged, host: KvPool, layer: int, batch: AttentionBatch
    ) -> PendingCpuAttention:
        """Once the rows are on the host, the kernel appends k/v at ``seq_len - 1`` of the host
        pool and attends, on the Rust pool, while this thread goes on."""
        q, k, v = staged.ready()
        c = batch.cpu_decodes
        out = self.transfer.host_buffer(q)
        handle = self.cpu_attention.submit(
            q,
            host.k,
            host.v,
            layer,
            c.block_tables,
            c.seq_lens,
            self.scale,
            out,
            new_k=k,
            new_v=v,
            **host.scales(),
        )
        return PendingCpuAttention(handle, out, self.transfer)

    def run_layer(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        device_pool: KvPool,
        host_pool: KvPool,
        layer: int,
        batch: AttentionBatch,
        out: torch.Tensor,
        clock: StageClock,
    ) -> PendingCpuAttention | None:
        """Issue the batch's whole attention: device rows into ``out`` now, CPU decodes
        submitted (the caller waits on the result when it needs it). The CPU part starts first
        when its inputs are already on the host, else after the device part is queued."""
        staged = self.stage_cpu(q, k, v, batch)
        pending = None
        if staged is not None and staged.immediate:
            pending = self.submit_cpu(staged, host_pool, layer, batch)
        self.device_part(q, k, v, device_pool, layer, batch, out, clock)
        if staged is not None and pending is None:
            pending = self.submit_cpu(staged, host_pool, layer, batch)
        return pending

    def prefill(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, pool: KvPool, layer: int, p: Prefill
    ) -> torch.Tensor:
        qh = q.transpose(0, 1)[None]  # [1, heads, rows, d]
        if p.num_computed == 0:
            # The whole prompt is in this chunk: attend to its own K/V, causally.
            kh, vh = k.transpose(0, 1)[None], v.transpose(0, 1)[None]
            out = F.scaled_dot_product_attention(
                qh, kh, vh, is_causal=True, scale=self.scale, enable_gqa=True
            )
        elif self.paged_prefill is not None:
            # A later chunk: earlier tokens are only in the pool, read there in place.
            return self.paged_prefill(
                q, pool.k[layer], pool.v[layer], p.block_table, p.num_computed, p.seq_len, self.scale
            )
        else:
            # A later chunk, without Triton: its context gathered from the pool.
            kvh = pool.layout.num_kv_heads
            kh = (
                pool.k[layer][p.block_table]
                .transpose(0, 1)
                .reshape(kvh, -1, q.shape[-1])[:, : p.seq_len][None]
            )
            vh = (
                pool.v[layer][p.block_table]
                .transpose(0, 1)
                .reshape(kvh, -1, q.shape[-1])[:, : p.seq_len][None]
            )
            rows = torch.arange(p.num_computed, p.seq_len, device=q.device)
            mask = torch.arange(p.seq_len, device=q.device)[None, :] <= rows[:, None]
            out = F.scaled_dot_product_attention(
                qh, kh, vh, attn_mask=mask, scale=self.scale, enable_gqa=True
            )
        return out[0].transpose(0, 1)

    def device_part(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        pool: KvPool,
        layer: int,
        batch: AttentionBatch,
        out: torch.Tensor,
        clock: StageClock,
    ) -> None:
        """GPU decodes and prefill chunks of the batch, into their rows of ``out``, each kind
        timed as its own stage."""
        g = batch.gpu_decodes
        if len(g):
            with clock.span("gpu_decode"):
                rows = slice(g.start, g.end)
                new_kv = (k[rows], v[rows]) if batch.append_decodes else None
                self.decode(q[rows], pool, layer, g, out[rows], new_kv)
        if batch.prefills:
            with clock.span("prefill_attn"):
                for p in batch.prefills:
                    rows = slice(p.start, p.end)
                    out[rows] = self.prefill(q[rows], k[rows], v[rows], pool, layer, p)
