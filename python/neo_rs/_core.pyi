"""Typed stubs of the Rust extension module ``neo_rs._core``."""

import numpy as np
import numpy.typing as npt
import torch

MAX_SPECULATIVE_TOKENS: int
"""The most draft tokens a decode verifies in one step."""

def simd_tiers() -> list[str]:
    """SIMD tiers this CPU supports, slowest first (``scalar``, ``avx2``, ``avx512``, ``neon``)."""

def peak_kv_blocks(
    num_tokens: int,
    *,
    block_size: int,
    max_num_batched_tokens: int,
    kv_group_windows: list[int | None] | None = None,
) -> int:
    """The most KV blocks of a pool a request of ``num_tokens`` cached tokens holds at once,
    summed over the KV groups: all of them for a global group (``None``), a chunk beyond the
    window for a sliding one. The scheduler refuses a request that needs more than a pool has."""

def quantize_rows(src: torch.Tensor, out: torch.Tensor, scales: torch.Tensor) -> None:
    """Each row (last dim) of ``src`` as the int8 host pool stores it, into ``out``: rotated by a
    normalized Hadamard transform, then symmetric int8 with one float32 scale per row into
    ``scales`` (``max|rotated row| / 127``), as the CPU kernel's fused append does."""

def dequantize_rows(src: torch.Tensor, scales: torch.Tensor, out: torch.Tensor) -> None:
    """``quantize_rows``' int8 rows and scales read back into the float tensor ``out``
    (dequantized, then rotated back)."""

class Bf16Linear:
    """A bf16 linear of a few rows on the CPU, ``out = x @ weight.T + bias``, reading the plain
    ``[n, k]`` weight front to back (AVX512_BF16 where the CPU has it, else scalar). The weight
    and bias (contiguous bfloat16 CPU tensors) are checked once and held; they must not be
    resized in place. The work is split over the calling thread's OpenMP team of
    ``num_threads``; ``path`` (``scalar``, ``avx512_bf16``) forces a kernel."""

    def __init__(
        self,
        weight: torch.Tensor,
        bias: torch.Tensor | None = None,
        *,
        num_threads: int,
        path: str | None = None,
    ) -> None: ...
    @property
    def path(self) -> str:
        """The kernel this object runs."""
    def forward(self, x: torch.Tensor, out: torch.Tensor) -> None:
        """``out`` (``[rows, n]``, bfloat16) = ``x`` (``[rows, k]``, bfloat16) @ weight.T + bias,
        each output summed in float32 and rounded once. GIL released."""

class Categorical:
    """Tokens from logits on the CPU: greedy ones (``argmax``), and random ones (``draw``): for
    each row, the inverse of the CDF of ``softmax(row / temperature)``, narrowed by top-k, top-p
    and min-p, at a uniform the caller drew, summed by SIMD blocks (``tier``: ``NEO_RS_SIMD``, else
    the best this CPU has), on the calling thread's OpenMP team of ``num_threads``. A row's token
    depends only on its row, its parameters and its uniform; ``-inf`` entries are never drawn."""

    def __init__(self, *, num_threads: int, tier: str | None = None) -> None: ...
    @property
    def tier(self) -> str: ...
    def draw(
        self,
        logits: torch.Tensor,
        rows: list[int],
        temperatures: list[float],
        top_ks: list[int],
        top_ps: list[float],
        min_ps: list[float],
        uniforms: list[float],
    ) -> list[int]:
        """The token of each row ``rows[i]`` of ``logits`` (``[num_rows, vocab]``, contiguous
        float32) at ``temperatures[i] > 0``, narrowed as vLLM narrows by ``top_ks[i]`` (0: off),
        ``top_ps[i]`` (1: off) and ``min_ps[i]`` (0: off; ties at a cut kept), at ``uniforms[i]``
        in ``[0, 1)``. GIL released."""
    def argmax(self, logits: torch.Tensor) -> list[int]:
        """Each row's first largest entry of ``logits`` (``[rows, vocab]``, contiguous float32 or
        bf16), as ``max(dim=-1).indices`` gives it. GIL released."""

class QuantGemm:
    """A weight-only int8, int4 or grouped int8 linear on the CPU for any number of rows, ``out =
    x @ W.T + bias``, of a model in bfloat16, float16 or float32 (the dtype of the scales, or of
    the groups, which ``x``, ``out`` and ``bias`` then take). The weight is packed in blocks of
    16 output columns, and in each, for every pair of inputs, each column's two weights (zeros
    pad): held, as are the groups, they must not be resized in place; int8's scales and the bias
    are copied. Each block is widened once a call (to bfloat16 on the AVX512_BF16 path for a
    bfloat16 model; to float32 otherwise) and multiplied by every row; each output is summed in
    float32 and rounded once. The work is split over the calling thread's OpenMP team of
    ``num_threads``; ``path`` (``scalar``, ``avx2``, ``avx512_bf16``, ``neon``, ``neon_bf16``)
    forces a kernel."""

    @staticmethod
    def int8(
        packed: torch.Tensor,
        scales: torch.Tensor,
        bias: torch.Tensor | None = None,
        *,
        n: int,
        k: int,
        num_threads: int,
        path: str | None = None,
    ) -> QuantGemm:
        """``W = q * scales[:, None]``: ``packed`` int8 ``[ceil(n / 16), ceil(k / 2), 16, 2]``,
        ``scales`` ``[n]`` in the model's dtype (applied to the float32 sums), ``bias`` ``[n]``."""
    @staticmethod
    def grouped(
        packed: torch.Tensor,
        groups: torch.Tensor,
        bias: torch.Tensor | None = None,
        *,
        n: int,
        k: int,
        group: int,
        bits: int,
        num_threads: int,
        path: str | None = None,
    ) -> QuantGemm:
        """A scale and a zero per ``group`` inputs (even, dividing ``k``) and column, ``groups``
        ``[ceil(n / 16), k / group, 2, 16]`` in the model's dtype (each block's and group's 16
        scales, then 16 zeros), applied to the float32 sums; ``bias`` ``[n]``. ``bits`` 4: ``W =
        (q - 8) * scale + zero``, ``packed`` uint8 ``[ceil(n / 16), k / 2, 16]`` (byte ``j`` of a
        pair: lane ``j`` in its low nibble, lane ``16 + j`` in its high one). ``bits`` 8: ``W = q
        * scale + zero`` (GGUF's blocks of 2 to 8 bits but Q4's, 8-bit GPTQ), ``packed`` int8 as
        ``int8``'s."""
    @property
    def path(self) -> str:
        """The kernel this object runs."""
    def forward(self, x: torch.Tensor, out: torch.Tensor) -> None:
        """``out`` (``[rows, n]``) = ``x`` (``[rows, k]``) @ W.T + bias, both in the model's
        dtype. GIL released."""

class AttentionHandle:
    def wait(self) -> None:
        """Block (GIL released) until the submitted call is done; raise its error, if any."""
    def done(self) -> bool: ...
    @property
    def run_ms(self) -> float | None:
        """Milliseconds the call ran on the pool (from its start); None until done."""

class CpuAttention:
    """CPU paged decode attention with a persistent thread pool.

    ``num_threads`` defaults to ``NEO_RS_CPU_THREADS``, else the machine's cores; ``simd`` to
    ``NEO_RS_SIMD``, else the best tier of this CPU. With ``openmp_team``, ``forward`` runs on the
    calling thread's OpenMP team of ``num_threads`` threads (torch's intra-op threads) instead of
    the pool, where an OpenMP runtime is loaded, and so does ``submit`` (before it returns: the
    team's threads are the cores the pool's would contend for). Without
    ``dot_products``, pools are read by the widening path alone (``int8_dot`` and ``bf16_dot`` off):
    f32 products and probabilities.
    """

    def __init__(
        self,
        num_threads: int | None = None,
        simd: str | None = None,
        openmp_team: bool = False,
        dot_products: bool = True,
    ) -> None: ...
    @property
    def simd(self) -> str: ...
    @property
    def num_threads(self) -> int: ...
    @property
    def openmp_team(self) -> bool:
        """Whether ``forward`` runs on the calling thread's OpenMP team (asked for, and an OpenMP
        runtime is loaded)."""
    @property
    def int8_dot(self) -> bool:
        """Whether int8 caches are read by integer dot products: q·k against q quantized per
        head after the softmax scale, p·v against p quantized to int16 per head and step of blocks
        (AVX-512 VNNI, or AVX-VNNI on the AVX2 tier; on Arm's DotProd q·k alone; unless
        ``NEO_RS_INT8_DOT=0``)."""
    @property
    def bf16_dot(self) -> bool:
        """Whether bf16 caches are read by bf16 dot products: q·k against q as bf16, p·v against
        the probabilities rounded to bf16, f32 accumulation (AVX512_BF16, unless
        ``NEO_RS_BF16_DOT=0``)."""
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
        k_scale: torch.Tensor | None = None,
        v_scale: torch.Tensor | None = None,
        window: int | None = None,
        softcap: float | None = None,
    ) -> None:
        """Decode attention, written into ``out``.

        q, out: ``[num_seqs, num_q_heads, head_dim]``; caches: ``[num_layers, num_blocks,
        num_kv_heads, block_size, head_dim]``; block_tables: int32 ``[num_seqs, max_blocks]``;
        seq_lens: int32 ``[num_seqs]`` (including the new token). With ``new_k``/``new_v``
        (``[num_seqs, num_kv_heads, head_dim]``) the new token's K/V are first written at
        position ``seq_len - 1``. All CPU, contiguous, one float dtype. Int8 caches come with
        float32 ``k_scale``/``v_scale`` ``[num_layers, num_blocks, num_kv_heads, block_size]``
        (row ``t`` of a head holds ``scale[t] * k[t]``); new rows are then quantized as they are
        written (symmetric, one scale per token and KV head). The caches (and the scales) may
        instead be the halves ``x[:, :, :, 0]`` and ``x[:, :, :, 1]`` of one contiguous ``x`` of
        ``[num_layers, num_blocks, num_kv_heads, 2, ...]``: each (block, KV head)'s K and V
        tiles side by side, as the engine's CPU pools hold them (read as one run). Releases the
        GIL. ``window``: each sequence attends to its last ``window`` positions only (a sliding
        window); ``softcap``: scaled scores become ``softcap * tanh(score / softcap)``.
        Calls reading under 256 KiB of K/V run on the calling thread (handing them to the pool
        would cost more).
        """
    def stream_read(self, buf: torch.Tensor) -> int:
        """Read every byte of ``buf`` once on this engine's pool; time it for the read bandwidth."""
    def gather_read(self, buf: torch.Tensor, run_bytes: int, order: torch.Tensor) -> int:
        """Read the ``run_bytes``-byte runs of ``buf`` at the run indices of the int32 tensor
        ``order``, in that order, on this engine's pool; time it with KV tiles as runs in block-table
        order for what the kernel's memory accesses alone reach."""
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
        k_scale: torch.Tensor | None = None,
        v_scale: torch.Tensor | None = None,
        window: int | None = None,
        softcap: float | None = None,
    ) -> AttentionHandle:
        """Like ``forward`` but returns at once; the tensors must not be touched before ``wait()``.
        A call under 256 KiB of K/V is done on return (cheaper than the hand-off)."""

class SchedulerOutput:
    """One iteration's plan; rows in batch order (``num_decodes`` decodes, then prefill chunks)."""

    req_ids: npt.NDArray[np.int64]
    num_computed_tokens: npt.NDArray[np.int64]
    num_new_tokens: npt.NDArray[np.int64]
    num_decodes: int
    num_cpu_decodes: int
    """The last ``num_cpu_decodes`` decode rows of sub-batch 0 attend over the host pool (slot -1)."""
    num_host_prefills: int
    """The last ``num_host_prefills`` prefills of sub-batch 0 write their KV to the host pool."""
    sub_batch1_start: int
    """Requests from here on are sub-batch 1 (CPU decodes); ``len(req_ids)`` when not pipelined."""
    input_ids: npt.NDArray[np.int64]
    positions: npt.NDArray[np.int64]
    slot_mapping: npt.NDArray[np.int64]
    """``[num_groups, num_tokens]``: each token's slot in each KV group's blocks."""
    query_start_loc: npt.NDArray[np.int32]
    seq_lens: npt.NDArray[np.int32]
    block_tables: npt.NDArray[np.int32]
    """``[num_groups, num_reqs, max_blocks]``: each KV group's tables (released blocks as 0)."""
    sample_rows: npt.NDArray[np.int64]
    sample_ids: npt.NDArray[np.int64]
    """The request of each sampled row; a request verifying ``k`` drafts has ``k + 1`` rows in a run
    (its rows' inputs: the last sampled token, then the drafts)."""
    swap_out: npt.NDArray[np.int64]
    """``[n, 2]`` (device block, host block) pairs; apply before ``swap_in`` and the forward."""
    swap_in: npt.NDArray[np.int64]
    """``[n, 2]`` (host block, device block) pairs."""
    prefill_to_host: npt.NDArray[np.int64]
    """``[n, 2]`` (device, host) block pairs of finishing prefills; copy each layer once written."""
    cache_to_host: npt.NDArray[np.int64]
    """``[n, 2]`` (device, host) pairs: prefix blocks evicted this iteration, into the host tier.
    Gather with ``swap_out`` (the device blocks are handed out again); nothing reads the host
    blocks before the next plan."""
    cache_to_device: npt.NDArray[np.int64]
    """``[n, 2]`` (host, device) pairs: host-tier prefix hits; apply with ``swap_in``."""
    recomputed: list[int]
    predicted: dict[str, float]
    """Predicted per-layer ms: linear0/1, prefill_attn, gpu_decode, cpu_attn0/1, transfer0/1, layer."""

class Scheduler:
    """Continuous-batching scheduler with chunked prefill and the KV accounting of both pools."""

    def __init__(
        self,
        *,
        max_num_seqs: int,
        max_num_batched_tokens: int,
        max_model_len: int,
        block_size: int,
        num_gpu_blocks: int,
        num_cpu_blocks: int,
        offload: str = "none",
        transfer_bytes_per_decode: int = 0,
        kv_bytes_per_token: int = 0,
        force_pipeline: bool = False,
        enable_prefix_caching: bool = False,
        num_cpu_prefix_blocks: int = 0,
        kv_group_windows: list[int | None] | None = None,
        speculation: tuple[int, tuple[int, int] | None, bool] | None = None,
    ) -> None:
        """``offload``: ``neo`` (partial offload, pipelined when it pays), ``none`` (GPU-only,
        overflow swapped) or ``all`` (every decode on the CPU). ``enable_prefix_caching``: new
        prompts start after the full device blocks they share with earlier ones.
        ``num_cpu_prefix_blocks``: host blocks that keep prefix blocks the device evicts (the
        host tier; needs ``enable_prefix_caching``). ``kv_group_windows``: the KV groups
        (layers sharing a table) and each one's sliding window (``None``: global; default one
        global group): a sliding group's blocks behind its window are released as requests
        advance. Prefix caching takes one group.
        ``speculation``: ``(num_tokens, (lookup_min, lookup_max) or None, always)``: each decode
        drafts up to ``num_tokens`` tokens by prompt lookup (or, with None, takes a draft model's
        from ``propose``), into the budget and blocks left over, as many as the predictor says
        pay (``always``, for tests: every one found)."""
    def add_request(
        self, request_id: int, prompt_token_ids: list[int], max_tokens: int, cache_salt: str | None = None
    ) -> None:
        """Queue a request; ``InvalidArgumentError`` if it can never run (empty, too long, duplicate).
        ``cache_salt``: it shares prefix-cache blocks only with requests of the same salt."""
    def abort(self, request_id: int) -> bool:
        """Drop a request wherever it is and free its blocks; ``False`` if unknown."""
    def num_cached_tokens(self, request_id: int) -> int:
        """Prompt tokens its first admission found in the prefix cache (0 if none, or unknown)."""
    def schedule(self) -> SchedulerOutput:
        """Plan one iteration; ``BackendError`` if the previous one got no ``update``/``abort_step``."""
    def update(
        self, sampled: list[int], stopped: list[int], counts: list[int] | None = None
    ) -> list[tuple[int, str]]:
        """One token per sampled request, or with ``counts`` (one per sampled request) that many:
        the drafts it accepted, then the token after them. ``stopped`` ids finish with ``stop``.
        Returns the finished requests."""
    def abort_step(self) -> list[int]:
        """The last ``schedule``'s iteration failed: abort the requests it ran or swapped (their ids)."""
    def draft_requests(self) -> list[tuple[int, int, int]]:
        """A draft model's work before ``schedule``: ``(request_id, drafts to make, longest)``
        for the running decodes whose drafts pay, the draft model's rounds priced in; ``longest``:
        the most tokens the request may reach (prompt and ``max_tokens``)."""
    def propose(self, request_ids: list[int], tokens: list[int], counts: list[int]) -> None:
        """The draft model's tokens (``counts[i]`` of them for ``request_ids[i]``) for the next
        ``schedule`` to verify."""
    def observe_draft_round(self, tokens: int, layer_ms: float) -> None:
        """A draft-model round over ``tokens`` tokens took ``layer_ms`` per layer of this model."""
    def rewind(self, request_id: int, token_ids: list[int]) -> None:
        """A draft model's scheduler following its target: the request's tokens become
        ``token_ids``; the KV of the tokens both share stays (no prefix caching, no window)."""
    def has_unfinished(self) -> bool: ...
    @property
    def num_waiting(self) -> int: ...
    @property
    def num_running(self) -> int: ...
    @property
    def num_swapped(self) -> int: ...
    def num_free_blocks(self, device_name: str) -> int: ...
    def num_total_blocks(self, device_name: str) -> int: ...
    def num_cached_blocks(self, device_name: str) -> int:
        """Blocks registered in the pool's prefix cache (held by requests or evictable)."""
    def stats(self) -> dict[str, int]: ...
    def set_perf_tables(
        self,
        linear: tuple[list[float], list[float]],
        prefill_attn: tuple[list[float], list[float]],
        gpu_decode: tuple[list[float], list[float], list[float]],
        cpu_decode: tuple[list[float], list[float], list[float]],
        transfer: tuple[list[float], list[float]],
        launch_ms: float,
    ) -> None:
        """Profiled per-layer tables (ms) for the ``neo`` policy; corrections restart at 1."""
    def observe(self, term_name: str, predicted_ms: float, measured_ms: float) -> None:
        """Fold a measured per-layer stage time into the correction of ``term_name``."""
    def perf_corrections(self) -> list[tuple[str, float]]: ...
    def check_invariants(self) -> None:
        """Raise ``BackendError`` if the KV accounting is inconsistent (call between iterations)."""
