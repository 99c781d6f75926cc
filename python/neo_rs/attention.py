"""Attention over the paged KV pool for one iteration: prefill chunks with torch SDPA (causal,
per sequence), one-token decodes with the Rust CPU kernel when the pool is in CPU memory, else a
torch gather fallback (CUDA until a CUDA kernel lands)."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from neo_rs._core import CpuAttention, SchedulerOutput
from neo_rs.kv_cache import KvPool


@dataclass
class Prefill:
    """Rows ``start:end`` of the batch: positions ``num_computed .. seq_len`` of one sequence."""

    start: int
    end: int
    num_computed: int
    seq_len: int
    block_table: torch.Tensor  # int64 block ids covering seq_len


@dataclass
class AttentionBatch:
    """The per-iteration metadata every layer's attention shares."""

    slot_mapping: torch.Tensor  # [tokens] int64, device
    num_decodes: int
    decode_block_tables: torch.Tensor  # [num_decodes, max_blocks] int32
    decode_seq_lens: torch.Tensor  # [num_decodes] int32
    prefills: list[Prefill]

    @staticmethod
    def from_plan(plan: SchedulerOutput, device: torch.device, block_size: int) -> AttentionBatch:
        nd = plan.num_decodes
        qsl, lens = plan.query_start_loc, plan.seq_lens
        tables = torch.from_numpy(plan.block_tables)
        prefills = []
        for i in range(nd, len(lens)):
            nblocks = -(-int(lens[i]) // block_size)
            start, end = int(qsl[i]), int(qsl[i + 1])
            seq_len = int(lens[i])
            prefills.append(
                Prefill(start, end, seq_len - (end - start), seq_len, tables[i, :nblocks].long().to(device))
            )
        return AttentionBatch(
            slot_mapping=torch.from_numpy(plan.slot_mapping).to(device),
            num_decodes=nd,
            decode_block_tables=tables[:nd].to(device),
            decode_seq_lens=torch.from_numpy(plan.seq_lens[:nd]).to(device),
            prefills=prefills,
        )


def paged_decode_torch(
    q: torch.Tensor,
    pool: KvPool,
    layer: int,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """Reference/fallback decode: gather each sequence's blocks, mask past its length, SDPA."""
    n, max_blocks = block_tables.shape
    bs = pool.layout.block_size
    idx = block_tables.long()
    # [n, max_blocks, kvh, bs, d] -> [n, kvh, max_blocks * bs, d]
    k = pool.k[layer][idx].permute(0, 2, 1, 3, 4).reshape(n, pool.layout.num_kv_heads, max_blocks * bs, -1)
    v = pool.v[layer][idx].permute(0, 2, 1, 3, 4).reshape(n, pool.layout.num_kv_heads, max_blocks * bs, -1)
    mask = torch.arange(max_blocks * bs, device=q.device)[None, :] < seq_lens.to(q.device).long()[:, None]
    out = F.scaled_dot_product_attention(
        q[:, :, None, :], k, v, attn_mask=mask[:, None, None, :], scale=scale, enable_gqa=True
    )
    return out[:, :, 0, :]


class Attention:
    """Runs one layer's attention for a whole batch; decodes go to ``cpu_attention`` when set."""

    def __init__(self, scale: float, cpu_attention: CpuAttention | None) -> None:
        self.scale = scale
        self.cpu_attention = cpu_attention

    def decode(
        self, q: torch.Tensor, pool: KvPool, layer: int, batch: AttentionBatch, out: torch.Tensor
    ) -> None:
        if self.cpu_attention is not None and pool.device.type == "cpu":
            self.cpu_attention.forward(
                q.contiguous(),
                pool.k,
                pool.v,
                layer,
                batch.decode_block_tables,
                batch.decode_seq_lens,
                self.scale,
                out,
            )
        else:
            out.copy_(
                paged_decode_torch(
                    q, pool, layer, batch.decode_block_tables, batch.decode_seq_lens, self.scale
                )
            )

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
        else:
            # A later chunk: earlier tokens are only in the pool.
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

    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        pool: KvPool,
        layer: int,
        batch: AttentionBatch,
    ) -> torch.Tensor:
        """q ``[T, heads, d]``, k/v ``[T, kv_heads, d]`` (already in the pool) -> ``[T, heads, d]``."""
        out = torch.empty_like(q)
        nd = batch.num_decodes
        if nd:
            self.decode(q[:nd], pool, layer, batch, out[:nd])
        for p in batch.prefills:
            out[p.start : p.end] = self.prefill(
                q[p.start : p.end], k[p.start : p.end], v[p.start : p.end], pool, layer, p
            )
        return out
