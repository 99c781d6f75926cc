"""The hardware cost model: per-layer stage times from FLOPs and bytes against the GPU's
compute and memory bandwidth (roofline, with efficiency factors), CPU attention from KV bytes
against host memory bandwidth, PCIe copies, launch overheads; pool sizes from memory. It feeds
the scheduler's perf predictor through the same tables the engine profiles.

Under tensor parallelism (a GPU profile with ``count`` > 1) everything is one rank's, as the
engine's profile is on rank 0: the rank's shard of the model (``ModelProfile.shard``, the engine's
split), one GPU, an equal share of the host's memory and bandwidth, and the two all-reduces per
layer over the GPUs' link."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from neo_rs.sim.profiles import GpuProfile, HostProfile, ModelProfile
from neo_rs.worker.profiler import PerfTables

GIB = 1 << 30


@dataclass(frozen=True)
class Efficiency:
    """Achieved share of the datasheet peaks (fit them with ``--calibrate`` style measurements)."""

    gemm: float = 0.6
    gpu_mem: float = 0.8
    attn: float = 0.4
    cpu_mem: float = 0.7
    pcie: float = 0.8
    kernel_launch_ms: float = 0.01  # per kernel
    cpu_handoff_ms: float = 0.05  # per CPU-attention hand-off
    iteration_ms: float = 1.0  # scheduling, sampling, the LM head: once per iteration


@dataclass(frozen=True)
class CostModel:
    gpu: GpuProfile
    host: HostProfile
    model: ModelProfile
    eff: Efficiency = Efficiency()
    block_size: int = 16
    gpu_mem_utilization: float = 0.9
    activation_reserve_gib: float = 1.0
    host_kv_share: float = 0.8  # of host memory given to the KV pool
    cpu_kv_int8: bool = False  # the host pool as int8 rows with a float32 scale each

    @property
    def rank_model(self) -> ModelProfile:
        return self.model.shard(self.gpu.count)

    @property
    def rank_gpu(self) -> GpuProfile:
        return self.gpu.rank()

    @property
    def rank_host(self) -> HostProfile:
        n = self.gpu.count
        return dataclasses.replace(self.host, mem_gib=self.host.mem_gib / n, mem_gbps=self.host.mem_gbps / n)

    def block_bytes(self) -> int:
        return self.rank_model.num_layers * self.rank_model.kv_bytes_per_token_layer() * self.block_size

    def host_kv_bytes_per_token_layer(self) -> int:
        """K and V of one token in one layer as the host pool stores them (and CPU attention
        reads them)."""
        m = self.rank_model
        return 2 * m.num_kv_heads * (m.head_dim + 4) if self.cpu_kv_int8 else m.kv_bytes_per_token_layer()

    def num_gpu_blocks(self) -> int:
        free = self.rank_gpu.mem_gib * self.gpu_mem_utilization - self.activation_reserve_gib
        return max(0, int((free * GIB - self.rank_model.weight_bytes()) // self.block_bytes()))

    def num_cpu_blocks(self) -> int:
        host_block = self.rank_model.num_layers * self.host_kv_bytes_per_token_layer() * self.block_size
        return int(self.rank_host.mem_gib * self.host_kv_share * GIB // host_block)

    # -- per-layer stage times (ms) ---------------------------------------------------------

    def linear_ms(self, tokens: float) -> float:
        m, e = self.rank_model, self.eff
        flops = 2 * tokens * m.active_layer_params()
        weights = m.read_layer_params(tokens) * m.layer_weight_bytes()
        compute = flops / (self.rank_gpu.tflops * 1e12 * e.gemm)
        memory = weights / (self.rank_gpu.mem_gbps * 1e9 * e.gpu_mem)
        return max(compute, memory) * 1e3 + 7 * e.kernel_launch_ms + 2 * self.all_reduce_ms(tokens)

    def all_reduce_ms(self, tokens: float) -> float:
        """One ring all-reduce of ``tokens`` hidden states (the row-parallel O and down
        projections' partial sums); 0 on one GPU."""
        n = self.gpu.count
        if n == 1:
            return 0.0
        if self.gpu.link_gbps <= 0:
            raise ValueError(f"GPU profile {self.gpu.name!r} spans {n} GPUs but has no link_gbps")
        nbytes = 2 * (n - 1) / n * tokens * self.model.hidden * self.model.dtype_bytes
        return nbytes / (self.gpu.link_gbps * 1e9 * self.eff.pcie) * 1e3 + self.eff.kernel_launch_ms

    def prefill_attn_ms(self, prompt_len: float) -> float:
        m = self.rank_model
        flops = 2 * prompt_len * prompt_len * m.num_heads * m.head_dim  # causal: half of 4 S^2 h d
        return flops / (self.rank_gpu.tflops * 1e12 * self.eff.attn) * 1e3 + self.eff.kernel_launch_ms

    def gpu_decode_ms(self, seqs: float, context_tokens: float) -> float:
        kv = context_tokens * self.rank_model.kv_bytes_per_token_layer()
        read_ms = kv / (self.rank_gpu.mem_gbps * 1e9 * self.eff.gpu_mem) * 1e3
        return read_ms + self.eff.kernel_launch_ms + 2e-5 * seqs

    def cpu_decode_ms(self, seqs: float, context_tokens: float) -> float:
        kv = context_tokens * self.host_kv_bytes_per_token_layer()
        return kv / (self.rank_host.mem_gbps * 1e9 * self.eff.cpu_mem) * 1e3 + 1e-4 * seqs

    def transfer_ms(self, nbytes: float) -> float:
        return nbytes / (self.rank_gpu.pcie_gbps * 1e9 * self.eff.pcie) * 1e3 + 0.005

    def transfer_bytes_per_decode(self) -> int:
        m = self.rank_model
        return (2 * m.num_heads + 2 * m.num_kv_heads) * m.head_dim * m.dtype_bytes

    def tables(self, max_tokens: int) -> PerfTables:
        """The predictor's tables, sampled from this model on grids like the engine's profile."""

        def grid(lo: float, hi: float, n: int = 24) -> list[float]:
            return [lo * (hi / lo) ** (i / (n - 1)) for i in range(n)]

        lin = grid(1, max(2, max_tokens))
        pre = grid(1, max(2, self.rank_model.max_len))
        ctx = [0.0, *grid(1, 1e8)]
        rows = [1.0, 4.0, 16.0, 64.0, 256.0, 1024.0, 4096.0]
        return PerfTables(
            linear=(lin, [self.linear_ms(x) for x in lin]),
            prefill_attn=(pre, [self.prefill_attn_ms(x) for x in pre]),
            gpu_decode=(rows, ctx, [self.gpu_decode_ms(s, n) for s in rows for n in ctx]),
            cpu_decode=(rows, ctx, [self.cpu_decode_ms(s, n) for s in rows for n in ctx]),
            transfer=([0.0, 1e10], [self.transfer_ms(0), self.transfer_ms(1e10)]),
            launch_ms=self.eff.cpu_handoff_ms,
        )
