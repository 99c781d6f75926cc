"""Start-up profile of per-layer stage times for NEO's perf predictor (Rust): linear work by
tokens, prefill attention by prompt length, device decode attention by context tokens, CPU
attention by sequences x tokens, device<->host copies by bytes, and the CPU hand-off cost. A
small grid, measured on this machine's real model and pools, cached on disk under a key of
everything that changes the numbers (a different key never reuses a table)."""

from __future__ import annotations

import hashlib
import json
import logging
import os
import platform
import statistics
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from tqdm import tqdm

from neo_rs._core import Scheduler
from neo_rs.attention.metadata import DecodeRows, Prefill
from neo_rs.cuda_runtime import runtime
from neo_rs.model.decoder import DecoderLayer, Rope

if TYPE_CHECKING:
    from neo_rs.worker.runner import ModelRunner

log = logging.getLogger(__name__)

# Part of the cache key: bump when what a profile measures changes (v4: small CPU attention
# calls run on the calling thread, without the pool hand-off; v5: no linear packed for one row).
VERSION = 5
Curve = tuple[list[float], list[float]]
Grid = tuple[list[float], list[float], list[float]]  # rows, columns, values row-major


@dataclass
class PerfTables:
    linear: Curve
    prefill_attn: Curve
    gpu_decode: Grid
    cpu_decode: Grid
    transfer: Curve
    launch_ms: float

    @staticmethod
    def from_json(d: dict[str, Any]) -> PerfTables:
        def curve(v: list[list[float]]) -> Curve:
            return [float(x) for x in v[0]], [float(y) for y in v[1]]

        def grid(v: list[list[float]]) -> Grid:
            rows, cols, vals = v
            return [float(x) for x in rows], [float(x) for x in cols], [float(x) for x in vals]

        return PerfTables(
            curve(d["linear"]),
            curve(d["prefill_attn"]),
            grid(d["gpu_decode"]),
            grid(d["cpu_decode"]),
            curve(d["transfer"]),
            float(d["launch_ms"]),
        )

    def apply(self, scheduler: Scheduler) -> None:
        scheduler.set_perf_tables(
            self.linear, self.prefill_attn, self.gpu_decode, self.cpu_decode, self.transfer, self.launch_ms
        )


def _device_name(device: torch.device) -> str:
    if device.type == "cuda":
        return runtime().device_name(device)
    return f"cpu:{platform.machine()}:{platform.processor() or 'unknown'}"


def profile_key(runner: ModelRunner, max_tokens: int) -> str:
    cfg = runner.model.config
    ident = {
        "version": VERSION,
        "model": [cfg.num_layers, cfg.hidden_size, cfg.intermediate_size, cfg.num_heads, cfg.num_kv_heads],
        "head_dim": cfg.head_dim,
        "qkv_bias": cfg.qkv_bias,
        # What else changes a layer's linear time: the family's extra norms and sparse MLPs.
        "family": [cfg.o_bias, cfg.qk_norm, cfg.post_norms, str(cfg.moe)],
        "dtype": str(runner.layout.dtype),
        "quantization": runner.quantization,
        "cpu_kv_dtype": str(runner.host_pool.k.dtype),
        "block_size": runner.layout.block_size,
        "device": _device_name(runner.device),
        "threads": [runner.attention.cpu_attention.num_threads, torch.get_num_threads()],
        "tensor_parallel_size": runner.tp.size,
        "max_tokens": max_tokens,
    }
    return hashlib.sha256(json.dumps(ident, sort_keys=True).encode()).hexdigest()[:20]


def _time_ms(device: torch.device, fn: Callable[[], object], reps: int = 3) -> float:
    """Median wall time of ``fn`` after one warm-up, device work included."""
    sync = (lambda: runtime().synchronize(device)) if device.type == "cuda" else (lambda: None)
    fn()
    sync()
    times = []
    for _ in range(reps):
        t = time.perf_counter()
        fn()
        sync()
        times.append((time.perf_counter() - t) * 1e3)
    return statistics.median(times)


def _pow2_grid(lo: int, hi: int) -> list[int]:
    grid, x = [], lo
    while x < hi:
        grid.append(x)
        x *= 2
    return [*grid, hi]


def _floats(xs: list[int]) -> list[float]:
    return [float(x) for x in xs]


def _decode_rows(total: int, seqs: int, block_size: int, device: torch.device) -> DecodeRows:
    """``seqs`` sequences sharing ``total`` tokens, over blocks ``0 .. total / block_size``."""
    per = max(total // seqs, 1)
    nb = -(-per // block_size)
    tables = (torch.arange(seqs * nb, dtype=torch.int32) % max(1, total // block_size)).reshape(seqs, nb)
    lens = torch.full((seqs,), per, dtype=torch.int32)
    return DecodeRows(0, seqs, tables.to(device), lens.to(device), per, tables, lens)


def _linear_step(layer: DecoderLayer, rope: Rope, x: torch.Tensor, o: torch.Tensor) -> None:
    layer.pre_attention(x, rope)
    layer.post_attention(o, x)


class _Profiler:
    def __init__(self, runner: ModelRunner, bar: tqdm) -> None:
        self.r, self.bar = runner, bar
        cfg = runner.model.config
        self.heads, self.kv_heads, self.head_dim = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        self.dev, self.dtype = runner.device, runner.layout.dtype

    def rand(self, *shape: int, device: torch.device | None = None) -> torch.Tensor:
        return torch.randn(*shape, dtype=self.dtype, device=device or self.dev)

    def time(self, fn: Callable[[], object], device: torch.device | None = None) -> float:
        self.bar.update()
        return _time_ms(device or self.dev, fn)

    def linear(self, grid: list[int], max_model_len: int) -> Curve:
        """A layer's linear stages at each token count: with dense and sparse MLP layers mixed
        (Qwen3-MoE's ``mlp_only_layers``), one of each kind timed and weighted by their counts."""
        model = self.r.model
        layers, hidden = model.decoder_layers, model.config.hidden_size
        kinds: dict[type, list[DecoderLayer]] = {}
        for layer in layers:
            kinds.setdefault(type(layer.mlp), []).append(layer)
        ys = []
        for t in grid:
            x, o = self.rand(t, hidden), self.rand(t, self.heads, self.head_dim)
            pos = torch.arange(t, device=self.dev) % max_model_len
            rope = model.rotary.at(pos, x.dtype)
            self.bar.update()
            times = [
                len(k) * _time_ms(self.dev, partial(_linear_step, k[0], rope, x, o)) for k in kinds.values()
            ]
            ys.append(sum(times) / len(layers))
        return _floats(grid), ys

    def prefill(self, grid: list[int]) -> Curve:
        ys = []
        for s in grid:
            q, k, v = (self.rand(s, h, self.head_dim) for h in (self.heads, self.kv_heads, self.kv_heads))
            p = Prefill(0, s, 0, s, torch.zeros(1, dtype=torch.long, device=self.dev))
            ys.append(self.time(partial(self.r.attention.prefill, q, k, v, self.r.device_pool, 0, p)))
        return _floats(grid), ys

    def _decode_table(
        self, rows_grid: list[int], cols_grid: list[int], device: torch.device, call: Callable[..., object]
    ) -> Grid:
        """``call(q, rows, out)`` timed for ``s`` sequences sharing ``n`` tokens, every (s, n)."""
        vals = []
        for s in rows_grid:
            for n in cols_grid:
                rows = _decode_rows(max(n, s), s, self.r.layout.block_size, device)
                q = self.rand(s, self.heads, self.head_dim, device=device)
                vals.append(self.time(partial(call, q, rows, torch.empty_like(q)), device))
        return _floats(rows_grid), _floats(cols_grid), vals

    def _gpu_call(self, q: torch.Tensor, rows: DecodeRows, out: torch.Tensor) -> None:
        self.r.attention.decode(q, self.r.device_pool, 0, rows, out)

    def _cpu_call(self, q: torch.Tensor, rows: DecodeRows, out: torch.Tensor) -> None:
        attn, host = self.r.attention, self.r.host_pool
        attn.cpu_attention.forward(
            q, host.k, host.v, 0, rows.block_tables, rows.seq_lens, attn.kinds[0].scale, out, **host.scales()
        )

    def gpu_decode(self, rows_grid: list[int], cols_grid: list[int]) -> Grid:
        return self._decode_table(rows_grid, cols_grid, self.dev, self._gpu_call)

    def cpu_decode(self, rows_grid: list[int], cols_grid: list[int]) -> Grid:
        return self._decode_table(rows_grid, cols_grid, torch.device("cpu"), self._cpu_call)

    def transfer(self, grid: list[int]) -> Curve:
        """Bytes moved (half each way, as CPU decodes move them) -> ms."""
        ys = []
        for nbytes in grid:
            x = torch.empty(nbytes // 4, dtype=torch.float16, device=self.dev)
            ys.append(self.time(partial(_round_trip, x)))
        return _floats(grid), ys

    def launch(self) -> float:
        """Submit + wait of a one-token CPU call, less what the kernel itself ran."""
        cpu, host, attn = torch.device("cpu"), self.r.host_pool, self.r.attention
        rows = _decode_rows(1, 1, self.r.layout.block_size, cpu)
        q = self.rand(1, self.heads, self.head_dim, device=cpu)
        out = torch.empty_like(q)
        costs = []
        for _ in range(20):
            t = time.perf_counter()
            h = attn.cpu_attention.submit(
                q,
                host.k,
                host.v,
                0,
                rows.block_tables,
                rows.seq_lens,
                attn.kinds[0].scale,
                out,
                **host.scales(),
            )
            h.wait()
            costs.append((time.perf_counter() - t) * 1e3 - (h.run_ms or 0.0))
        self.bar.update()
        return max(0.0, statistics.median(costs))


def _round_trip(x: torch.Tensor) -> None:
    x.to("cpu", copy=True).to(x.device, copy=True)


@torch.inference_mode()
def profile(
    runner: ModelRunner, max_tokens: int, max_model_len: int, show_progress: bool = True
) -> PerfTables:
    """Under tensor parallelism every rank runs this in step (the linear stages all-reduce);
    rank 0's tables are the ones used."""
    bs = runner.layout.block_size
    linear_grid = _pow2_grid(1, max_tokens)
    prefill_grid = _pow2_grid(16, max(16, min(max_model_len, max_tokens)))
    dev_tokens = max(bs, min(runner.device_pool.num_blocks * bs, 1 << 15))
    gpu_rows = [s for s in (1, 4, 16, 64) if s * bs <= dev_tokens] or [1]
    gpu_cols = sorted({*_pow2_grid(bs, dev_tokens)[::2], dev_tokens})
    host_tokens = max(bs, min(runner.host_pool.num_blocks * bs, 1 << 16))
    cpu_rows = [s for s in (1, 4, 16, 64) if s * bs <= host_tokens] or [1]
    cpu_cols = sorted({*_pow2_grid(bs, host_tokens)[::2], host_tokens})
    transfer_grid = [1 << 12, 1 << 16, 1 << 20, 1 << 24]
    total = (
        len(linear_grid)
        + len(prefill_grid)
        + len(gpu_rows) * len(gpu_cols)
        + len(cpu_rows) * len(cpu_cols)
        + len(transfer_grid)
        + 1
    )
    with tqdm(total=total, desc="Profiling stage times", unit="pt", disable=not show_progress) as bar:
        p = _Profiler(runner, bar)
        return PerfTables(
            linear=p.linear(linear_grid, max_model_len),
            prefill_attn=p.prefill(prefill_grid),
            gpu_decode=p.gpu_decode(gpu_rows, gpu_cols),
            cpu_decode=p.cpu_decode(cpu_rows, cpu_cols),
            transfer=p.transfer(transfer_grid),
            launch_ms=p.launch(),
        )


def load_or_profile(
    runner: ModelRunner,
    max_tokens: int,
    max_model_len: int,
    cache: Path,
    on_profile: Callable[[int, int], None] | None = None,
) -> PerfTables:
    """The cached tables, or a fresh profile (``on_profile(max_tokens, max_model_len)`` first:
    tensor parallelism's workers join it)."""
    path = cache / "profiles" / f"{profile_key(runner, max_tokens)}.json"
    if path.is_file():
        try:
            tables = PerfTables.from_json(json.loads(path.read_text()))
            log.info("perf profile from %s", path)
            return tables
        except (ValueError, TypeError, KeyError, IndexError) as e:
            log.warning("ignoring the unreadable perf profile %s (%s)", path, e)
    t = time.perf_counter()
    if on_profile is not None:
        on_profile(max_tokens, max_model_len)
    tables = profile(runner, max_tokens, max_model_len)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(f".{os.getpid()}.tmp")  # processes profiling at once each write their own
    tmp.write_text(json.dumps(asdict(tables)))
    tmp.replace(path)
    log.info("profiled stage times in %.1f s, cached in %s", time.perf_counter() - t, path)
    return tables
