"""Typed stubs of the Rust extension module ``neo_rs._core``."""

import torch

class NeoRsError(Exception): ...
class ShapeError(NeoRsError): ...
class DTypeError(NeoRsError): ...
class InvalidArgumentError(NeoRsError): ...
class BackendError(NeoRsError): ...

def simd_tiers() -> list[str]:
    """SIMD tiers this CPU supports, slowest first (``scalar``, ``avx2``, ``avx512``, ``neon``)."""

class AttentionHandle:
    def wait(self) -> None:
        """Block (GIL released) until the submitted call is done; raise its error, if any."""
    def done(self) -> bool: ...

class CpuAttention:
    """CPU paged decode attention with a persistent thread pool.

    ``num_threads`` defaults to ``NEO_RS_CPU_THREADS``, else the machine's cores; ``simd`` to
    ``NEO_RS_SIMD``, else the best tier of this CPU.
    """

    def __init__(self, num_threads: int | None = None, simd: str | None = None) -> None: ...
    @property
    def simd(self) -> str: ...
    @property
    def num_threads(self) -> int: ...
    def forward(
        self,
        q: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        layer: int,
        block_tables: torch.Tensor,
        seq_lens: torch.Tensor,
        scale: float,
        out: torch.Tensor,
        new_k: torch.Tensor | None = None,
        new_v: torch.Tensor | None = None,
    ) -> None:
        """Decode attention, written into ``out``.

        q, out: ``[num_seqs, num_q_heads, head_dim]``; caches: ``[num_layers, num_blocks,
        num_kv_heads, block_size, head_dim]``; block_tables: int32 ``[num_seqs, max_blocks]``;
        seq_lens: int32 ``[num_seqs]`` (including the new token). With ``new_k``/``new_v``
        (``[num_seqs, num_kv_heads, head_dim]``) the new token's K/V are first written at
        position ``seq_len - 1``. All CPU, contiguous, one float dtype. Releases the GIL.
        """
    def stream_read(self, buf: torch.Tensor) -> int:
        """Read every byte of ``buf`` once on this engine's pool; time it for the read bandwidth."""
    def submit(
        self,
        q: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        layer: int,
        block_tables: torch.Tensor,
        seq_lens: torch.Tensor,
        scale: float,
        out: torch.Tensor,
        new_k: torch.Tensor | None = None,
        new_v: torch.Tensor | None = None,
    ) -> AttentionHandle:
        """Like ``forward`` but returns at once; the tensors must not be touched before ``wait()``."""
