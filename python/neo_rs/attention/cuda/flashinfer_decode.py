"""FlashInfer's batch decode over our device pool, used on CUDA when ``flashinfer`` is installed
(the optional extra ``neo_rs[flashinfer]``). Our per-layer pools ``[num_blocks, num_kv_heads,
block_size, head_dim]`` are its ``HND`` paged layout, so it reads them in place. The page table
goes over in its CSR form (``paged_kv_args``), planned once per iteration and sub-batch from host
tensors, so planning never waits on the device; every layer then only runs."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

from neo_rs.config import AttentionKind
from neo_rs.kv.pools import KvPool

if TYPE_CHECKING:
    from neo_rs.attention.metadata import DecodeRows

# FlashInfer's float workspace (its split-K partials); vLLM sizes it the same.
_WORKSPACE_BYTES = 128 << 20


def paged_kv_args(
    block_tables: torch.Tensor, seq_lens: torch.Tensor, block_size: int, window: int | None = None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """FlashInfer's page table from our padded one (host int32 tensors in, host int32 out):
    ``indptr`` ``[n + 1]``, request ``b``'s pages being ``indices[indptr[b]:indptr[b + 1]]`` in
    order, and ``last_page_len`` ``[n]``, the tokens in its last page (0 for an empty request).
    Under a sliding ``window`` the pages wholly before it are left out: no query reads them, and
    they may have been released (block 0 in our tables). The window still counts from the last
    token, so FlashInfer's ``window_left`` selects the same keys."""
    lens = seq_lens.long()
    pages = (lens + block_size - 1) // block_size
    first = (lens - window).clamp(min=0) // block_size if window is not None else torch.zeros_like(lens)
    indptr = torch.zeros(len(lens) + 1, dtype=torch.int32)
    indptr[1:] = (pages - first).cumsum(0)
    page = torch.arange(block_tables.shape[1])[None, :]
    used = (page < pages[:, None]) & (page >= first[:, None])
    indices = block_tables[used].to(torch.int32)  # row-major: request by request, pages in order
    last = torch.where(pages > 0, lens - (pages - 1) * block_size, 0).to(torch.int32)
    return indptr, indices, last


class _Planned:
    """One wrapper and the rows it is planned for (FlashInfer plans a window and a cap with them)."""

    def __init__(self, wrapper: Any) -> None:
        self.wrapper: Any = wrapper
        self.rows: DecodeRows | None = None


class FlashInferDecode:
    """The ``DeviceDecode`` backend (``attention/device_decode.py``) on FlashInfer's
    ``BatchDecodeWithPagedKVCacheWrapper``: one wrapper per attention kind of the model's layers
    and KV group (Gemma's sliding and global layers plan apart, over their groups' tables), each
    with its own workspace."""

    plans_on_host = True  # its plan() reads the lengths on the host: no CUDA graph around it

    def __init__(self, device: torch.device) -> None:
        import flashinfer  # noqa: PLC0415 (optional)

        self._make = flashinfer.BatchDecodeWithPagedKVCacheWrapper
        self._device = device
        self._by_kind: dict[tuple[AttentionKind, int], _Planned] = {}

    def __call__(
        self,
        q: torch.Tensor,
        pool: KvPool,
        layer: int,
        rows: DecodeRows,
        kind: AttentionKind,
        out: torch.Tensor,
    ) -> None:
        planned = self._by_kind.get((kind, rows.group))
        if planned is None:
            workspace = torch.empty(_WORKSPACE_BYTES, dtype=torch.uint8, device=self._device)
            planned = self._by_kind[kind, rows.group] = _Planned(self._make(workspace, "HND"))
        if rows is not planned.rows:
            layout = pool.layout
            indptr, indices, last = paged_kv_args(
                rows.host_tables, rows.host_lens, layout.block_size, kind.window
            )
            planned.wrapper.plan(
                indptr,
                indices,
                last,
                q.shape[1],
                layout.num_kv_heads,
                layout.head_dim,
                layout.block_size,
                pos_encoding_mode="NONE",
                q_data_type=q.dtype,
                kv_data_type=pool.k.dtype,
                sm_scale=kind.scale,
                window_left=-1 if kind.window is None else kind.window - 1,
                logits_soft_cap=kind.softcap,
            )
            planned.rows = rows
        planned.wrapper.run(q.contiguous(), (pool.k[layer], pool.v[layer]), out=out)
