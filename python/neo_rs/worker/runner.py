"""The model runner: owns the weights, both KV pools and the attention backends, applies a
plan's swaps and runs its forward pass (one batch, every layer's three stages in order; CPU
decodes attend over the host pool, finishing host-bound prefills are copied there layer by layer)
up to the logits of the sampled rows."""

from __future__ import annotations

import logging
import os
import time
from dataclasses import dataclass, replace
from functools import partial
from pathlib import Path

import numpy as np
import torch

from neo_rs._core import CpuAttention, SchedulerOutput
from neo_rs.attention.layer import Attention, PendingCpuAttention
from neo_rs.attention.metadata import AttentionBatch
from neo_rs.config import EngineArgs, ModelConfig
from neo_rs.cuda_runtime import runtime
from neo_rs.environment import emulate_async_copies, enforce_eager_default, openmp_team
from neo_rs.errors import InvalidArgumentError
from neo_rs.kv.groups import KvGroups
from neo_rs.kv.layer_copies import LayerCopies
from neo_rs.kv.pools import KvLayout, KvPool, block_pairs
from neo_rs.kv.transfer import HostTransfer, Staged
from neo_rs.model.decoder import CausalLM, Rope
from neo_rs.model.fp8 import scaled_mm_runs
from neo_rs.model.fp8_checkpoint import load_fp8_linears
from neo_rs.model.gguf_blocks import GgufBlocks
from neo_rs.model.gptq_awq import load_packed_linears
from neo_rs.model.loader import empty_model, load_model, shard_files
from neo_rs.model.packed import GEMV_ROWS, pack_linears, packing_applies
from neo_rs.model.prequantized import quantize_at_load
from neo_rs.model.quant import grouped_int8_runs, quantizer, warn_unquantized_experts
from neo_rs.model.rust_linears import gemv_applies
from neo_rs.parallel.group import SINGLE_PROCESS, TensorParallel, rank_device
from neo_rs.timing import HostWaits, MeasuredTimes, StageClock
from neo_rs.worker.compiled import CompiledStack, why_eager
from neo_rs.worker.graphs import DecodeGraphs
from neo_rs.worker.memory_plan import plan_activations

log = logging.getLogger(__name__)

# Device pool budget when the "device" is the CPU and no block count is given.
_CPU_DEVICE_KV_BYTES = 2 << 30


def resolve_device(name: str | None) -> torch.device:
    if name is None:
        return torch.device("cuda" if runtime().available() else "cpu")
    dev = torch.device(name)
    if dev.type == "cuda" and not runtime().available():
        raise InvalidArgumentError("device 'cuda' was asked for, but CUDA is not available")
    if dev.type not in ("cuda", "cpu"):
        raise InvalidArgumentError(f"device must be cuda or cpu, got {name!r}")
    return dev


def _prefix_tier_blocks(args: EngineArgs, num_cpu: int, per_block: int) -> int:
    """Host blocks of the prefix cache's host tier (``EngineArgs.cpu_prefix_cache_gib``)."""
    if not args.enable_prefix_caching:
        return 0
    if args.cpu_prefix_cache_gib is None:
        return num_cpu // 4
    return min(num_cpu, int(args.cpu_prefix_cache_gib * (1 << 30)) // per_block)


def cpu_attention(args: EngineArgs, device: torch.device) -> CpuAttention:
    """The Rust kernel's engine. Beside a GPU it has threads of its own (``cpu_threads``, else
    ``NEO_RS_CPU_THREADS``, else every core), which work while the GPU does. On a CPU device the
    model and the kernel take turns on the same cores, so one count is both torch's intra-op
    threads and the kernel's (``cpu_threads`` or ``NEO_RS_CPU_THREADS`` when given, else torch's),
    and blocking calls run on torch's own OpenMP threads (``rust/team.rs``): never more
    threads than cores, and none left spinning beside the kernel's."""
    if device.type != "cpu":
        return CpuAttention(num_threads=args.cpu_threads)
    given = args.cpu_threads is not None or bool(os.environ.get("NEO_RS_CPU_THREADS"))
    threads = args.cpu_threads if given else torch.get_num_threads()
    attn = CpuAttention(num_threads=threads, openmp_team=openmp_team())
    torch.set_num_threads(attn.num_threads)
    return attn


@dataclass(frozen=True)
class RunnerSetup:
    """What a runner is built from; under tensor parallelism rank 0 broadcasts it to the
    workers, and every rank builds its own runner from it."""

    args: EngineArgs
    model_dir: Path
    cfg: ModelConfig
    dtype: torch.dtype
    device: torch.device  # rank 0's device type; each rank maps it to its own (``rank_device``)
    max_model_len: int

    def build(self, tp: TensorParallel = SINGLE_PROCESS) -> ModelRunner:
        device = rank_device(self.device, tp.rank)
        return ModelRunner(self.args, self.model_dir, self.cfg, self.dtype, device, self.max_model_len, tp)


class ModelRunner:
    def __init__(
        self,
        args: EngineArgs,
        model_dir: Path,
        cfg: ModelConfig,
        dtype: torch.dtype,
        device: torch.device,
        max_model_len: int,
        tp: TensorParallel = SINGLE_PROCESS,
    ) -> None:
        """Under tensor parallelism, rank ``tp.rank``'s runner: its shard of the model, and pools
        of its KV heads (as many blocks on every rank)."""
        self.device, self.tp = device, tp
        self.quantization = quantization = args.quantization_for(cfg)
        self.model = self._load(model_dir, cfg, dtype, max_model_len, quantization)
        cfg_all, cfg = cfg, self.model.config  # the whole model's shapes, this rank's
        kinds = cfg.attention_kinds()
        self.kv_groups = KvGroups.of([k.window for k in kinds])
        self.layout = KvLayout(
            self.kv_groups.num_slots, cfg.num_kv_heads, args.block_size, cfg.head_dim, dtype
        )
        self.transfer = HostTransfer(device, emulate_async=emulate_async_copies())
        self.attention = Attention(kinds, cpu_attention(args, device), self.transfer, self.kv_groups)
        if packing_applies(device, dtype):
            # After ``cpu_attention``, which sets torch's threads: the Rust linears run on them.
            gemv_threads = torch.get_num_threads() if gemv_applies() else None
            packed, compute = pack_linears(self.model, args.max_num_seqs, gemv_threads)
            if packed == 0:
                log.warning(
                    "bf16 linears left to torch: oneDNN has no bf16 GEMM here, and f32 copies do not fit"
                )
            else:
                log.info(
                    "prepacked %d bf16 linears for oneDNN, computing in %s "
                    "(Rust kernel for up to %s rows, by width: %s)",
                    packed,
                    compute,
                    GEMV_ROWS,
                    gemv_threads is not None,
                )
        # On a GPU, room for one worst-case iteration's activations is kept from the KV pools. The
        # trace runs this rank's heads and FFN columns in one process (no collectives on fake
        # tensors) and the whole vocabulary's logits, as rank 0 gathers them.
        traced = replace(cfg, vocab_size=cfg_all.vocab_size)
        self.activation_plan = (
            plan_activations(
                partial(empty_model, traced, dtype, device, max_model_len),
                self.attention.kinds,
                device,
                args.token_budget,
                args.max_sampled_rows,
            )
            if device.type == "cuda"
            else None
        )
        if self.activation_plan is not None:
            plan = self.activation_plan
            log.info(
                "activation plan: %.0f MiB traced for %d tokens and %d sampled rows; %.0f MiB kept free",
                plan.peak_bytes / 2**20,
                plan.tokens,
                plan.rows,
                plan.reserve_bytes / 2**20,
            )
        per_block = self.layout.bytes_per_block()
        int8 = args.cpu_kv_dtype == "int8"
        host_per_block = self.layout.bytes_per_block(quantized=int8)
        num_gpu = tp.agree_min(args.num_gpu_blocks or self._device_blocks(args, max_model_len))
        num_cpu = tp.agree_min(
            args.num_cpu_blocks
            if args.num_cpu_blocks is not None
            else int(args.cpu_kv_gib * (1 << 30)) // host_per_block
        )
        self.num_cpu_prefix_blocks = _prefix_tier_blocks(args, num_cpu, host_per_block)
        graphs = args.cuda_graphs and self.attention.graph_safe
        if args.cuda_graphs and not graphs:
            log.warning("CUDA graphs are off: FlashInfer's decode plans on the host each iteration")
        # With graphs, one block more than the scheduler's: where padded rows write (graphs.py).
        self.device_pool = KvPool(self.layout, num_gpu + int(graphs), device)
        self.graphs = (
            DecodeGraphs(
                self.graph_forward,
                self.transfer,
                args.block_size,
                args.max_num_seqs,
                max_model_len,
                num_gpu,
                self.kv_groups.num_groups,
            )
            if graphs
            else None
        )
        self.host_pool = KvPool(self.layout, num_cpu, torch.device("cpu"), quantized=int8)
        log.info(
            "KV pools: %d device blocks (%.2f GiB), %d host blocks (%.2f GiB, %s; %d for the "
            "prefix cache's host tier), %d tokens per block",
            num_gpu,
            num_gpu * per_block / (1 << 30),
            num_cpu,
            num_cpu * host_per_block / (1 << 30),
            "int8" if int8 else "model dtype",
            self.num_cpu_prefix_blocks,
            args.block_size,
        )
        self.last_times = MeasuredTimes()
        # Copies into the host pool not yet waited on: this iteration's swap-outs (waited for
        # before the forward: CPU attention may read them), host-bound prefill rows, staged
        # blocks and evicted prefix blocks (waited for after it: nothing reads those host blocks
        # before the next plan).
        self._swapped_out: Staged | None = None
        self._landing: list[Staged] = []
        # Last: its warm-up runs ``attend``, which uses the state above.
        self.compiled = self._compiled(args)

    def _compiled(self, args: EngineArgs) -> CompiledStack | None:
        eager = enforce_eager_default() if args.enforce_eager is None else args.enforce_eager
        reason = "enforce_eager" if eager else why_eager(self.model, self.device, self.tp.size)
        if self.device.type == "cpu":
            log.info(
                "iterations of one batch: %s",
                "compiled decoder stack" if reason is None else f"eager ({reason})",
            )
        if reason is not None:
            return None
        compiled = CompiledStack(self.model, self.attend)
        try:
            compiled.warm_up()
        except Exception as e:  # a machine without a C++ compiler, say: serve, only slower
            log.warning("compiling the decoder stack failed, every iteration runs eager: %s", e)
            return None
        return compiled

    def _load(
        self,
        model_dir: Path,
        cfg: ModelConfig,
        dtype: torch.dtype,
        max_model_len: int,
        quantization: str | None,
    ) -> CausalLM:
        """This rank's model, its decoder linears kept as ``quantization`` says (a quantized
        checkpoint's own, or quantized now) or in ``dtype``."""
        device, tp = self.device, self.tp
        gguf = None
        if quantization == "gguf" and cfg.gguf_file:
            gguf = GgufBlocks(cfg.gguf_file, cfg, tp.shard, grouped_int8=grouped_int8_runs(device, dtype))
        later = gguf.weights if gguf else set()
        at_load = quantization in ("int8", "int4", "fp8")  # quantized now, from the float checkpoint
        model = load_model(model_dir, cfg, dtype, device, max_model_len, tp, later, quantize_later=at_load)
        capability = runtime().capability(device) if device.type == "cuda" else None
        scaled_mm = scaled_mm_runs(device, capability, dtype)
        if cfg.quantized_checkpoint is not None:  # kept, or dequantized (--quantization none)
            files, keep = shard_files(model_dir), quantization is not None
            if cfg.quantized_checkpoint.method == "fp8":
                block = cfg.quantized_checkpoint.block
                kept, floats = load_fp8_linears(model, files, cfg, tp.shard, keep, scaled_mm, block)
            else:
                kept, floats = load_packed_linears(model, files, cfg, tp.shard, keep)
            log.info("%d linears kept as the checkpoint has them, %d dequantized to %s", kept, floats, dtype)
        elif gguf is not None:
            kept, left = gguf.keep(model)
            log.info("kept %d linears as the GGUF's blocks, %d others in %s", kept, left, dtype)
            if gguf.dequantized_types:
                log.warning(
                    "the GGUF's %s linears are dequantized to %s: only our kernels keep them "
                    "(CUDA, or a CPU with AVX512_BF16)",
                    "/".join(gguf.dequantized_types),
                    dtype,
                )
        elif quantization is not None:
            make = quantizer(quantization, scaled_mm)
            count = quantize_at_load(model, shard_files(model_dir), cfg, tp.shard, make)
            warn_unquantized_experts(model, quantization)
            log.info("quantized %d linears to %s (weight-only)", count, quantization)
        if device.type == "cuda":
            # What loading freed (float weights quantized, the rotary tables' first allocation)
            # back to the driver, where the pools' sizing sees it; torch's cache keeps it else.
            runtime().empty_cache()
        return model

    def _device_blocks(self, args: EngineArgs, max_model_len: int) -> int:
        per_block = self.layout.bytes_per_block()
        if self.device.type == "cuda":
            free, total = runtime().mem_get_info(self.device)
            assert self.activation_plan is not None
            # Leave (1 - utilization) of the card, and room for one worst-case iteration.
            budget = free - (1 - args.gpu_memory_utilization) * total - self.activation_plan.reserve_bytes
        else:
            per_seq = self.kv_groups.num_groups * -(-max_model_len // args.block_size)
            wanted = args.max_num_seqs * per_seq * per_block
            budget = min(wanted, _CPU_DEVICE_KV_BYTES)
        blocks = int(budget // per_block)
        if blocks < 1:
            reserve = self.activation_plan.reserve_bytes if self.activation_plan else 0
            raise InvalidArgumentError(
                "no device memory is left for the KV cache; use a smaller model, raise "
                "gpu_memory_utilization, or lower max_num_batched_tokens or max_num_seqs (one "
                f"iteration's activations are kept free: {reserve / (1 << 30):.2f} GiB)"
            )
        return blocks

    def kv_bytes_per_token(self) -> int:
        """K and V of one token in one layer, as the device holds (and copies) them."""
        return self.layout.bytes_per_block() // (self.layout.num_layers * self.layout.block_size)

    def cpu_kv_bytes_per_token(self) -> int:
        """K and V of one token in one layer as the host pool stores them (what CPU attention
        reads: int8 rows and their scales, or the model dtype)."""
        per_block = self.layout.bytes_per_block(quantized=self.host_pool.quantized)
        return per_block // (self.layout.num_layers * self.layout.block_size)

    def transfer_bytes_per_decode(self) -> int:
        """Per layer, one CPU decode sends q, k, v to the host and its output back."""
        cfg, elem = self.model.config, torch.empty((), dtype=self.layout.dtype).element_size()
        return (2 * cfg.num_heads + 2 * cfg.num_kv_heads) * cfg.head_dim * elem

    @property
    def num_gpu_blocks(self) -> int:
        """The device blocks the scheduler hands out (not the graphs' scratch block)."""
        return self.device_pool.num_blocks - (self.graphs is not None)

    @property
    def num_cpu_blocks(self) -> int:
        return self.host_pool.num_blocks

    def apply_swaps(self, plan: SchedulerOutput) -> None:
        """Swap-outs: device blocks gathered now, every layer (the plan may hand them to others),
        which ``execute`` waits for before its CPU attention can read them (under ``neo`` a
        swapped-out request decodes on the CPU at once). The plan's other copies between the
        pools run layer by layer in ``execute`` (``LayerCopies``)."""
        if len(plan.swap_out):
            dev, host = self.device_pool, self.host_pool
            self._swapped_out = self.transfer.blocks_to_host(dev, host, block_pairs(plan.swap_out, dev, host))

    @torch.inference_mode()
    def execute(self, plan: SchedulerOutput) -> torch.Tensor:
        """Run the plan's tokens through the model; the logits of its sampled rows
        (``compute_logits``). Stage times are left in ``last_times``."""
        clock = StageClock(self.device, HostWaits())
        self.last_times = MeasuredTimes(clock, waits=clock.waits)
        self.transfer.waits, self.transfer.clock = clock.waits, clock
        # Before the swap-outs land: blocks bound for the device are gathered from the host now.
        copies = LayerCopies.of_plan(plan, self.transfer, self.device_pool, self.host_pool, self.kv_groups)
        self._landing = copies.landing
        if self._swapped_out is not None:
            self._swapped_out.ready()
            self._swapped_out = None
        if self.graphs is not None and self.graphs.takes(plan, copies):
            logits = self.graphs.run(plan)
        else:
            logits = self._eager(plan, copies, clock)
        for staged in self._landing:  # the host pool is whole again before the next plan
            staged.ready()
        self._landing.clear()
        self.transfer.clock = None  # swaps, between iterations, are not priced by the plan
        return logits

    def graph_forward(
        self, ids: torch.Tensor, positions: torch.Tensor, batch: AttentionBatch
    ) -> torch.Tensor:
        """A graphed decode iteration's device work (``graphs.py``), untimed: a capture records
        no events."""
        x = self.model.embed(ids)
        x = self._sequential(x, positions, batch, None, StageClock(self.device, HostWaits(), timed=False))
        return self.model.compute_logits(x)

    def _eager(self, plan: SchedulerOutput, copies: LayerCopies, clock: StageClock) -> torch.Tensor:
        up = self.transfer.upload
        ids, positions = up(torch.from_numpy(plan.input_ids)), up(torch.from_numpy(plan.positions))
        sample_rows = up(torch.from_numpy(np.ascontiguousarray(plan.sample_rows)))
        batches = AttentionBatch.from_plan(plan, self.transfer, self.layout.block_size)
        x = self.model.embed(ids)
        if len(batches) == 1:
            run = self._sequential if self.compiled is None else self.compiled.run
            x = run(x, positions, batches[0], copies, clock)
        elif self.compiled is not None and self.attention.cpu_attention.openmp_team:
            # The kernel runs on the model's own OpenMP team, done when submitted: NEO's pipeline
            # overlaps nothing here, so its sub-batches run compiled one after the other, the
            # plan's copies with the first (as the pipeline gives them to it).
            sub = zip(batches, (copies, None), strict=True)
            x = torch.cat([self.compiled.run(x[b.tokens], positions[b.tokens], b, c, clock) for b, c in sub])
        else:
            x = self._pipelined(x, positions, batches[0], batches[1], copies, clock)
        num_cpu = sum(len(b.cpu_decodes) for b in batches)
        self.last_times.transfer_bytes = (
            num_cpu * self.transfer_bytes_per_decode() * len(self.model.decoder_layers)
        )
        return self.model.compute_logits(x[sample_rows])

    def discard_pending(self) -> None:
        """Forget the copies into the host pool of an iteration that failed: the requests whose
        blocks they fill are aborted, and their blocks may be handed out again."""
        self._swapped_out = None
        self._landing.clear()

    def _pre(
        self,
        i: int,
        x: torch.Tensor,
        rope: Rope,
        batch: AttentionBatch,
        copies: LayerCopies | None,
        clock: StageClock,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Stage 1 of layer ``i`` and its KV writes."""
        with clock.span("linear"):
            q, k, v = self.model.decoder_layers[i].pre_attention(x, rope)
        self._write_kv(i, k, v, batch, copies)
        return q, k, v

    def _write_kv(
        self, i: int, k: torch.Tensor, v: torch.Tensor, batch: AttentionBatch, copies: LayerCopies | None
    ) -> None:
        """Layer ``i``'s KV writes: device rows to the device pool, host prefills to the host
        pool; around them the layer's share of the plan's copies (``copies``, given to the first
        sub-batch)."""
        pool = self.device_pool
        if copies is not None:
            copies.before_writes(i)
        groups = self.attention.groups
        slot, batch = groups.slot[i], batch.group(groups.group[i])
        for r, slots in batch.device_writes:
            pool.write(slot, slots, k[r], v[r])
        if batch.host_writes is not None:
            h, slots = batch.host_writes
            self._landing.append(self.transfer.rows_to_host(self.host_pool, slot, slots, k[h], v[h]))
        if copies is not None:
            copies.after_writes(i)

    def attend(
        self,
        i: int,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        batch: AttentionBatch,
        copies: LayerCopies | None,
        clock: StageClock,
    ) -> torch.Tensor:
        """Layer ``i``'s KV writes and its whole attention, its CPU decodes (NEO's hand-off to
        the host) waited for: one layer of ``_sequential``, and the compiled stack's
        ``neo_rs::layer_attention``."""
        self._write_kv(i, k, v, batch, copies)
        out = torch.empty_like(q)
        pending = self.attention.run_layer(q, k, v, self.device_pool, self.host_pool, i, batch, out, clock)
        if pending is not None:
            c = batch.cpu_decodes
            out[c.start : c.end] = self._cpu_result(pending)
        return out

    def _post(self, i: int, out: torch.Tensor, x: torch.Tensor, clock: StageClock) -> torch.Tensor:
        with clock.span("linear"):
            return self.model.decoder_layers[i].post_attention(out, x)

    def _cpu_result(self, pending: PendingCpuAttention) -> torch.Tensor:
        t = time.perf_counter()
        out = pending.result()
        self.last_times.cpu_wait_ms += (time.perf_counter() - t) * 1e3
        self.last_times.cpu_attn_ms.append(pending.handle.run_ms or 0.0)
        return out

    def _sequential(
        self,
        x: torch.Tensor,
        positions: torch.Tensor,
        batch: AttentionBatch,
        copies: LayerCopies | None,
        clock: StageClock,
    ) -> torch.Tensor:
        """Layer by layer; beside a GPU, CPU decodes (if any) run while the device attention is
        issued (on a CPU device, before it, on the same cores)."""
        rope = self.model.rotary.at(positions, x.dtype)
        for i, layer in enumerate(self.model.decoder_layers):
            with clock.span("linear"):
                q, k, v = layer.pre_attention(x, rope)
            x = self._post(i, self.attend(i, q, k, v, batch, copies, clock), x, clock)
        return x

    def _pipelined(
        self,
        x: torch.Tensor,
        positions: torch.Tensor,
        b0: AttentionBatch,
        b1: AttentionBatch,
        copies: LayerCopies,
        clock: StageClock,
    ) -> torch.Tensor:
        """NEO's asymmetric pipeline: sub-batch 0 runs half a layer ahead of sub-batch 1 (CPU
        decodes only). B1's CPU attention of layer i runs while the device does B0's post-
        projection i and pre-projection i+1; B0's CPU decodes of layer i+1 run while the device
        does B0's attention i+1 and B1's projections. CPU work is submitted asynchronously and
        awaited only when its output is needed."""
        layers, attn = self.model.decoder_layers, self.attention
        pool, host = self.device_pool, self.host_pool
        x0, x1 = x[b0.tokens], x[b1.tokens]
        r0, r1 = (self.model.rotary.at(positions[b.tokens], x.dtype) for b in (b0, b1))

        def start0(i: int, x0: torch.Tensor) -> tuple[torch.Tensor, PendingCpuAttention | None]:
            q, k, v = self._pre(i, x0, r0, b0, copies, clock)
            out = torch.empty_like(q)
            return out, attn.run_layer(q, k, v, pool, host, i, b0, out, clock)

        o0, h0 = start0(0, x0)
        q1, k1, v1 = self._pre(0, x1, r1, b1, None, clock)
        for i in range(len(layers)):
            if h0 is not None:
                c = b0.cpu_decodes
                o0[c.start : c.end] = self._cpu_result(h0)
            staged1 = attn.stage_cpu(q1, k1, v1, b1)
            assert staged1 is not None, "sub-batch 1 holds CPU decodes"
            h1 = attn.submit_cpu(staged1, host, i, b1)
            x0 = self._post(i, o0, x0, clock)
            if i + 1 < len(layers):
                o0, h0 = start0(i + 1, x0)
            x1 = self._post(i, self._cpu_result(h1), x1, clock)
            if i + 1 < len(layers):
                q1, k1, v1 = self._pre(i + 1, x1, r1, b1, None, clock)
        return torch.cat([x0, x1])
