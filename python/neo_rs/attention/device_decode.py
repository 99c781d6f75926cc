"""Decode attention over the device pool on CUDA (on a CPU device the Rust kernel reads the pool
directly, ``layer.py``). Three backends with one call, each planning once per iteration and
sub-batch (the first layer's call for a new ``DecodeRows``) and only running in later layers:

- FlashInfer's batch decode, when ``flashinfer`` is installed (``cuda/flashinfer_decode.py``);
- our Triton kernel (``cuda/paged_decode.py``), which ships with CUDA builds of torch;
- plain torch, which gathers each sequence's tokens by slot and runs SDPA.

``NEO_RS_DEVICE_ATTENTION`` picks one (``auto``, the default, takes the first available). Later
prefill chunks over the pool take our Triton kernel (``cuda/paged_prefill.py``) unless it says
``torch`` or Triton does not import (then ``layer.py`` gathers the context for SDPA)."""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

import torch
import torch.nn.functional as F

from neo_rs.config import AttentionKind
from neo_rs.environment import device_attention
from neo_rs.errors import InvalidArgumentError
from neo_rs.kv.pools import KvPool

if TYPE_CHECKING:
    from neo_rs.attention.metadata import DecodeRows

log = logging.getLogger(__name__)

BACKENDS = ("auto", "flashinfer", "triton", "torch")


class DeviceDecode(Protocol):
    def __call__(
        self,
        q: torch.Tensor,
        pool: KvPool,
        layer: int,
        rows: DecodeRows,
        kind: AttentionKind,
        out: torch.Tensor,
    ) -> None:
        """``out[i]`` = attention of ``q[i]`` (``[rows, heads, head_dim]``) over layer ``layer``
        of the first ``rows.seq_lens[i]`` tokens of row ``i``'s blocks, as ``kind`` says."""


@dataclass(frozen=True)
class TokenIndex:
    """Where each token of each row lies in the pool: ``[rows, max_len]`` block ids and in-block
    offsets, and which of them the row attends to (within its length and its window)."""

    blocks: torch.Tensor
    offsets: torch.Tensor
    valid: torch.Tensor

    @staticmethod
    def of(
        block_tables: torch.Tensor, seq_lens: torch.Tensor, block_size: int, max_len: int, window: int | None
    ) -> TokenIndex:
        """Positions past a row's length or before its window read its last token instead: it
        is written, so never-cleared pool memory (NaN and inf included) and blocks released
        behind the window (block 0 in the tables) are never read, and masking the scores is
        enough."""
        pos = torch.arange(max(max_len, 1), device=block_tables.device)[None, :]
        lens = seq_lens.long()[:, None]
        valid = pos < lens
        if window is not None:
            valid &= pos >= lens - window
        pos = torch.where(valid, pos, (lens - 1).clamp(min=0))
        blocks = block_tables.long().gather(1, pos // block_size)
        return TokenIndex(blocks, pos % block_size, valid)


def masked_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor, kind: AttentionKind
) -> torch.Tensor:
    """SDPA of ``q`` ``[..., heads, rows, d]`` over ``k``/``v`` ``[..., kv_heads, keys, d]`` where
    ``mask`` is true, scaled as ``kind`` says; soft-capped scores (SDPA has no hook for them) in
    plain torch, in float32."""
    if kind.softcap is None:
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=kind.scale, enable_gqa=True)
    group = q.shape[-3] // k.shape[-3]
    k, v = (t.repeat_interleave(group, -3).float() for t in (k, v))
    scores = torch.matmul(q.float(), k.transpose(-1, -2)) * kind.scale
    scores = kind.softcap * torch.tanh(scores / kind.softcap)
    return torch.matmul(torch.softmax(scores.masked_fill(~mask, float("-inf")), dim=-1), v).to(q.dtype)


def paged_decode_torch(
    q: torch.Tensor, pool: KvPool, layer: int, index: TokenIndex, kind: AttentionKind
) -> torch.Tensor:
    """Decode attention in plain torch: the rows' tokens gathered (only up to the longest row),
    then attention masked past each length and before the window ``index`` was made for
    (``kind``'s); an empty row gives zeros."""
    # Advanced indices around a slice: [rows, max_len, kv_heads, head_dim].
    k = pool.k[layer][index.blocks, :, index.offsets].transpose(1, 2)
    v = pool.v[layer][index.blocks, :, index.offsets].transpose(1, 2)
    out = masked_attention(q[:, :, None, :], k, v, index.valid[:, None, None, :], kind)
    return out[:, :, 0, :].masked_fill(~index.valid.any(dim=1)[:, None, None], 0.0)


class TorchDecode:
    def __init__(self) -> None:
        # Per KV group, the rows planned for and their index per window (Gemma's layers
        # alternate two; a hybrid model's groups have tables of their own).
        self._planned: dict[int, tuple[DecodeRows, dict[int | None, TokenIndex]]] = {}

    def __call__(
        self,
        q: torch.Tensor,
        pool: KvPool,
        layer: int,
        rows: DecodeRows,
        kind: AttentionKind,
        out: torch.Tensor,
    ) -> None:
        planned = self._planned.get(rows.group)
        if planned is None or planned[0] is not rows:
            planned = self._planned[rows.group] = rows, {}
        indices = planned[1]
        if kind.window not in indices:
            indices[kind.window] = TokenIndex.of(
                rows.block_tables, rows.seq_lens, pool.layout.block_size, rows.max_seq_len, kind.window
            )
        out.copy_(paged_decode_torch(q, pool, layer, indices[kind.window], kind))


class TritonDecode:
    def __init__(self) -> None:
        from neo_rs.attention.cuda.paged_decode import SplitPlan, paged_decode  # noqa: PLC0415 (needs Triton)

        self._kernel, self._split = paged_decode, SplitPlan.for_lengths
        self._planned: dict[int, tuple[DecodeRows, SplitPlan]] = {}  # per KV group

    def __call__(
        self,
        q: torch.Tensor,
        pool: KvPool,
        layer: int,
        rows: DecodeRows,
        kind: AttentionKind,
        out: torch.Tensor,
    ) -> None:
        planned = self._planned.get(rows.group)
        if planned is None or planned[0] is not rows:
            planned = self._planned[rows.group] = rows, self._split(rows.max_seq_len, pool.layout.block_size)
        k, v, plan = pool.k[layer], pool.v[layer], planned[1]
        self._kernel(
            q.contiguous(),
            k,
            v,
            rows.block_tables,
            rows.seq_lens,
            kind.scale,
            out,
            plan.num_splits,
            plan.blocks_per_split,
            kind.window or 0,
            kind.softcap or 0.0,
        )


def select_device_decode(device: torch.device) -> DeviceDecode:
    """The backend ``NEO_RS_DEVICE_ATTENTION`` names; under ``auto`` the first of FlashInfer, Triton
    and torch that imports here. A named backend that cannot be used is an error."""
    want = device_attention()
    if want not in BACKENDS:
        choices = ", ".join(BACKENDS)
        raise InvalidArgumentError(f"NEO_RS_DEVICE_ATTENTION must be one of {choices}, got {want!r}")
    if want == "torch":
        return TorchDecode()
    candidates = {"flashinfer": _flashinfer, "triton": _triton}
    for name, make in candidates.items():
        if want not in ("auto", name):
            continue
        try:
            backend = make(device)
        except (ImportError, OSError, RuntimeError) as e:  # not installed, or no usable build
            if want == name:
                raise InvalidArgumentError(
                    f"NEO_RS_DEVICE_ATTENTION={name}, but it does not import: {e}"
                ) from e
            log.info("device decodes: %s is unavailable (%s)", name, e)
            continue
        log.info("device decodes: %s", name)
        return backend
    log.warning("device decodes use the torch fallback (neither FlashInfer nor Triton imports)")
    return TorchDecode()


# (q, k_cache, v_cache, block_table, num_computed, seq_len, scale, window or 0, softcap or 0)
# -> the chunk's attention
PagedPrefill = Callable[
    [torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, int, int, float, int, float], torch.Tensor
]


def select_paged_prefill() -> PagedPrefill | None:
    """Our Triton kernel for later prefill chunks on CUDA, or None for the torch gather."""
    if device_attention() == "torch":
        return None
    try:
        from neo_rs.attention.cuda.paged_prefill import paged_prefill  # noqa: PLC0415 (needs Triton)
    except ImportError as e:
        log.warning("later prefill chunks gather their context for SDPA (Triton does not import: %s)", e)
        return None
    return paged_prefill


def _flashinfer(device: torch.device) -> DeviceDecode:
    from neo_rs.attention.cuda.flashinfer_decode import FlashInferDecode  # noqa: PLC0415

    return FlashInferDecode(device)


def _triton(device: torch.device) -> DeviceDecode:
    return TritonDecode()
