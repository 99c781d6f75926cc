"""Attention over the paged KV pools for one iteration: prefill chunks with torch SDPA (causal,
per sequence; a later chunk over a pool in CPU memory in the Rust kernel, a row at a time);
device decodes with the Rust CPU kernel when the device pool is in CPU memory, else a CUDA
backend (``device_decode.py``: FlashInfer, our Triton kernel, or plain torch); CPU decodes
(NEO's offloaded requests) with the Rust kernel over the host pool, appending their new K/V
there. Each layer attends as its ``AttentionKind`` says (scale, sliding window,
soft-capping), in every one of these paths."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from neo_rs._core import AttentionHandle, CpuAttention
from neo_rs.attention.device_decode import masked_attention, select_device_decode, select_paged_prefill
from neo_rs.attention.metadata import AttentionBatch, DecodeRows, Prefill
from neo_rs.config import AttentionKind
from neo_rs.kv.groups import KvGroups
from neo_rs.kv.pools import KvPool
from neo_rs.kv.transfer import HostTransfer, Staged
from neo_rs.timing import StageClock


def attend_positions(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, first: int, kind: AttentionKind
) -> torch.Tensor:
    """Rows ``q`` ``[rows, heads, head_dim]`` at positions ``first ..`` attending causally over
    ``k``/``v`` ``[keys, kv_heads, head_dim]`` (positions ``0 ..``), as ``kind`` says."""
    qh, kh, vh = (t.transpose(0, 1)[None] for t in (q, k, v))
    rows, keys = q.shape[0], k.shape[0]
    if first == 0 and rows == keys and kind.window is None and kind.softcap is None:
        out = F.scaled_dot_product_attention(qh, kh, vh, is_causal=True, scale=kind.scale, enable_gqa=True)
        return out[0].transpose(0, 1)
    pos_q = torch.arange(first, first + rows, device=q.device)[:, None]
    pos_k = torch.arange(keys, device=q.device)[None, :]
    mask = pos_k <= pos_q
    if kind.window is not None:
        mask &= pos_k > pos_q - kind.window
    return masked_attention(qh, kh, vh, mask, kind)[0].transpose(0, 1)


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
    decodes too when the device pool lives in CPU memory; there, ``prompt_attention`` (the same
    kernel without dot products: f32 products and probabilities) attends prompts' first chunks
    (``metadata.FIRST_CHUNK_KERNEL_ROWS_MAX``). With bf16 dot products (the probabilities rounded
    to bf16 for p·v), the default server's greedy answer to its smoke-test question changed: a
    near-tie in its first token, which torch's SDPA, and f32 probabilities, resolve the other way."""

    def __init__(
        self,
        kinds: list[AttentionKind],
        cpu_attention: CpuAttention,
        transfer: HostTransfer,
        groups: KvGroups,
    ) -> None:
        self.kinds = kinds  # per layer
        # Where each layer's KV lives: its group's tables, its slot on the pools' layer axis.
        self.groups = groups
        self.cpu_attention = cpu_attention
        self.prompt_attention = (
            CpuAttention(
                num_threads=cpu_attention.num_threads,
                simd=cpu_attention.simd,
                openmp_team=cpu_attention.openmp_team,
                dot_products=False,
            )
            if transfer.device.type == "cpu"
            else None
        )
        self.transfer = transfer
        cuda = transfer.device.type == "cuda"
        self.device_decode = select_device_decode(transfer.device) if cuda else None
        self.paged_prefill = select_paged_prefill() if cuda else None

    @property
    def graph_safe(self) -> bool:
        """Whether a decode iteration can be captured in a CUDA graph (not when the backend plans
        on the host each iteration)."""
        return not getattr(self.device_decode, "plans_on_host", False)

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
        slot = self.groups.slot[layer]
        if pool.device.type == "cpu":
            new_k, new_v = (t.contiguous() for t in new_kv) if new_kv is not None else (None, None)
            self.cpu_attention.forward(
                q.contiguous(),
                pool.k,
                pool.v,
                slot,
                rows.block_tables,
                rows.seq_lens,
                self.kinds[layer].scale,
                out,
                new_k=new_k,
                new_v=new_v,
                window=self.kinds[layer].window,
                softcap=self.kinds[layer].softcap,
            )
            return
        assert new_kv is None and self.device_decode is not None, "a CUDA pool: a device backend, no append"
        self.device_decode(q, pool, slot, rows, self.kinds[layer], out)

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
        c = batch.group(self.groups.group[layer]).cpu_decodes
        out = self.transfer.host_buffer(q)
        handle = self.cpu_attention.submit(
            q,
            host.k,
            host.v,
            self.groups.slot[layer],
            c.block_tables,
            c.seq_lens,
            self.kinds[layer].scale,
            out,
            new_k=k,
            new_v=v,
            **host.scales(),
            window=self.kinds[layer].window,
            softcap=self.kinds[layer].softcap,
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
        kind, slot = self.kinds[layer], self.groups.slot[layer]
        if p.kernel_rows is not None:
            # Its K/V is written: each row reads the pool up to its own position.
            out = torch.empty_like(q)
            tables, lens = p.kernel_rows
            engine = self.cpu_attention if p.num_computed else self.prompt_attention
            assert engine is not None, "kernel rows only over a pool in CPU memory"
            engine.forward(
                q.contiguous(),
                pool.k,
                pool.v,
                slot,
                tables,
                lens,
                kind.scale,
                out,
                window=kind.window,
                softcap=kind.softcap,
            )
            return out
        if p.num_computed == 0:
            return attend_positions(q, k, v, 0, kind)
        if self.paged_prefill is not None:
            # A later chunk: earlier tokens are only in the pool, read there in place.
            return self.paged_prefill(
                q,
                pool.k[slot],
                pool.v[slot],
                p.block_table,
                p.num_computed,
                p.seq_len,
                kind.scale,
                kind.window or 0,
                kind.softcap or 0.0,
            )
        # A later chunk, without Triton: its context gathered from the pool, from the block of
        # the first row's first attended position (blocks before it may have been released).
        bs, kvh = pool.layout.block_size, pool.layout.num_kv_heads
        skip = max(p.num_computed + 1 - kind.window, 0) // bs * bs if kind.window is not None else 0
        kc, vc = (
            c[slot][p.block_table[skip // bs :]]
            .transpose(0, 1)
            .reshape(kvh, -1, q.shape[-1])[:, : p.seq_len - skip]
            .transpose(0, 1)
            for c in (pool.k, pool.v)
        )
        return attend_positions(q, kc, vc, p.num_computed - skip, kind)

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
        batch = batch.group(self.groups.group[layer])
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
