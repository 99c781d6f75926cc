"""The per-iteration attention metadata every layer shares, built once from the scheduler's plan:
prefill chunks, decode rows over one pool, and the sub-batch (``AttentionBatch``) that holds them,
one per KV group (``kv/groups.py``: each group has its own block tables and slots). vLLM's
attention metadata builders are the model."""

from __future__ import annotations

from dataclasses import dataclass, replace

import numpy as np
import torch

from neo_rs._core import SchedulerOutput
from neo_rs.kv.pools import Slots, split_slots
from neo_rs.kv.transfer import HostTransfer

# The most rows of a later chunk the Rust kernel attends (a decode row each) instead of torch's
# SDPA over the gathered context: per call, 0.25x SDPA's time at 5 rows, 0.6x at 16, 0.86x (bf16)
# to 1.06x (fp32) at 64, 1.4x (fp32) at 256 (SmolLM2's heads, 1k context, 2 threads, AMD EPYC).
KERNEL_ROWS_MAX = 64
# The most rows of a first chunk (a prompt from its start) the Rust kernel attends, a decode row
# each over the pool its K/V was just written to, instead of torch's causal SDPA (CPU flash
# attention). Prompts run the kernel without dot products (``Attention.prompt_attention``). Per
# layer against SDPA per prompt, SmolLM2's heads, 2 threads, AMD EPYC Zen 5
# (``benches/prefill_attention.py``): 64 prompts of 128 tokens 0.53x the time in bf16, 0.57x in
# fp32; one prompt of 1,024 0.67x and 0.80x; of 2,048 0.80x but 1.03x in fp32, where the rows'
# re-reads of their context outgrow the caches.
FIRST_CHUNK_KERNEL_ROWS_MAX = 1024


@dataclass
class Prefill:
    """Rows ``start:end`` of the batch: positions ``num_computed .. seq_len`` of one sequence."""

    start: int
    end: int
    num_computed: int
    seq_len: int
    block_table: torch.Tensor  # int64 block ids covering seq_len
    # A short chunk over a pool in CPU memory (a decode verifying drafts, a prompt's last rows, a
    # whole prompt of up to ``FIRST_CHUNK_KERNEL_ROWS_MAX``): each row attends in the Rust kernel
    # as a decode at its own position, over these int32 tables and lengths (a row each).
    kernel_rows: tuple[torch.Tensor, torch.Tensor] | None = None


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
    group: int = 0  # the KV group whose tables these are (backends keep a plan per group)

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
    # With several KV groups, the same rows over each group's tables and slots (this batch is
    # group 0's); empty with one group.
    by_group: tuple[AttentionBatch, ...] = ()

    def group(self, g: int) -> AttentionBatch:
        """The batch over KV group ``g``'s tables and slots."""
        return self.by_group[g] if self.by_group else self

    @staticmethod
    def from_plan(plan: SchedulerOutput, transfer: HostTransfer, block_size: int) -> list[AttentionBatch]:
        """One batch per sub-batch of the plan (two when it is pipelined); each batch's rows
        count from its own first token."""
        n, s1 = len(plan.req_ids), plan.sub_batch1_start
        nd, ncd, nhp = plan.num_decodes, plan.num_cpu_decodes, plan.num_host_prefills
        subs = [(0, s1, (nd, ncd, nhp))] + ([(s1, n, (n - s1, n - s1, 0))] if s1 < n else [])
        groups = range(plan.block_tables.shape[0])
        batches = []
        for lo, hi, counts in subs:
            by_group = [AttentionBatch._rows(plan, g, lo, hi, counts, transfer, block_size) for g in groups]
            first = by_group[0]
            batches.append(replace(first, by_group=tuple(by_group)) if len(by_group) > 1 else first)
        return batches

    @staticmethod
    def _rows(
        plan: SchedulerOutput,
        group: int,
        lo: int,
        hi: int,
        counts: tuple[int, int, int],
        transfer: HostTransfer,
        block_size: int,
    ) -> AttentionBatch:
        """Requests ``lo:hi`` over KV group ``group``; ``counts``: their decodes, CPU decodes among
        them, host prefills. Everything the device reads is uploaded here, once per iteration,
        not per layer."""
        up = transfer.upload

        def up_slots(rows: slice) -> Slots:
            block, offset = split_slots(slots[rows], block_size)
            return up(block), up(offset)

        nd, ncd, nhp = counts
        ngd = nd - ncd
        qsl = plan.query_start_loc[lo : hi + 1] - plan.query_start_loc[lo]
        lens = plan.seq_lens[lo:hi]
        tables = torch.from_numpy(plan.block_tables[group, lo:hi])
        seq_lens = torch.from_numpy(lens)
        prefills = []
        on_host = transfer.device.type == "cpu"
        # Prompts bound for the host pool (host prefills, the last ``nhp``; prompts staged through
        # device blocks) name blocks of it in their tables: their first chunks attend their fresh
        # K/V, not the device pool.
        staged = len(plan.prefill_to_host) > 0
        for i in range(nd, hi - lo):
            nblocks = -(-int(lens[i]) // block_size)
            start, end = int(qsl[i]), int(qsl[i + 1])
            seq_len = int(lens[i])
            computed = seq_len - (end - start)
            kernel_rows = None
            rows_max = KERNEL_ROWS_MAX if computed else FIRST_CHUNK_KERNEL_ROWS_MAX
            in_device_pool = not staged and i < hi - lo - nhp
            if on_host and end - start <= rows_max and (computed or in_device_pool):
                row_lens = torch.arange(computed + 1, seq_len + 1, dtype=torch.int32)
                kernel_rows = (tables[i : i + 1].expand(end - start, -1).contiguous(), row_lens)
            prefills.append(
                Prefill(start, end, computed, seq_len, up(tables[i, :nblocks].long()), kernel_rows)
            )
        t0, t1 = int(plan.query_start_loc[lo]), int(plan.query_start_loc[hi])
        slots = plan.slot_mapping[group, t0:t1]
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
        gpu_rows, gpu_tables, gpu_lens = ngd, tables[:ngd], seq_lens[:ngd]
        short = prefills and all(p.num_computed > 0 and p.end - p.start <= KERNEL_ROWS_MAX for p in prefills)
        if short and cpu_end == cpu_start and host == t1 - t0 and (append_decodes or not on_host):
            # Later chunks all short (decodes verifying drafts) beside device decodes alone: every
            # row is a decode at its own position, all rows' K/V written first (by the Rust kernel
            # on a CPU device, by the device writes on a GPU), so the whole batch takes the decode
            # path: compiled where decodes run compiled, one launch of the device decode kernel
            # (Triton, FlashInfer, the torch fallback) for every row rather than a paged prefill
            # per request.
            gpu_rows, prefills = t1 - t0, []
            gpu_tables = tables.repeat_interleave(torch.from_numpy(np.diff(qsl)), dim=0)
            gpu_lens = torch.from_numpy(plan.positions[t0:t1] + 1).to(torch.int32)
            cpu_start = cpu_end = host = gpu_rows
            decodes_written = 0 if append_decodes else gpu_rows
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
                gpu_rows,
                up(gpu_tables),
                up(gpu_lens),
                int(gpu_lens.max()) if gpu_rows else 0,
                gpu_tables,
                gpu_lens,
                group,
            ),
            cpu_decodes=DecodeRows(
                cpu_start,
                cpu_end,
                cpu_tables,
                cpu_lens,
                int(lens[ngd:nd].max(initial=0)),
                cpu_tables,
                cpu_lens,
                group,
            ),
            prefills=prefills,
            append_decodes=append_decodes,
        )
