"""The hardware cost model: per-layer stage times from FLOPs and bytes against the GPU's
compute and memory bandwidth (roofline, with efficiency factors), CPU attention from KV bytes
against host memory bandwidth, PCIe copies, launch overheads; pool sizes from memory. It feeds
the scheduler's perf predictor through the same tables the engine profiles."""

from __future__ import annotations

from dataclasses import dataclass

from neo_rs.profiler import PerfTables
from neo_rs.sim.profiles import GpuProfile, HostProfile, ModelProfile

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

    def block_bytes(self) -> int:
        return self.model.num_layers * self.model.kv_bytes_per_token_layer() * self.block_size

    def host_kv_bytes_per_token_layer(self) -> int:
        """K and V of one token in one layer as the host pool stores them (and CPU attention
        reads them)."""
        m = self.model
        return 2 * m.num_kv_heads * (m.head_dim + 4) if self.cpu_kv_int8 else m.kv_bytes_per_token_layer()

    def num_gpu_blocks(self) -> int:
        free = self.gpu.mem_gib * self.gpu_mem_utilization - self.activation_reserve_gib * self.gpu.count
        return max(0, int((free * GIB - self.model.weight_bytes()) // self.block_bytes()))

    def num_cpu_blocks(self) -> int:
        host_block = self.model.num_layers * self.host_kv_bytes_per_token_layer() * self.block_size
        return int(self.host.mem_gib * self.host_kv_share * GIB // host_block)

    # -- per-layer stage times (ms) ---------------------------------------------------------

    def linear_ms(self, tokens: float) -> float:
        m, e = self.model, self.eff
        flops = 2 * tokens * m.layer_params()
        weights = m.layer_params() * m.dtype_bytes
        compute = flops / (self.gpu.tflops * 1e12 * e.gemm)
        memory = weights / (self.gpu.mem_gbps * 1e9 * e.gpu_mem)
        return max(compute, memory) * 1e3 + 7 * e.kernel_launch_ms

    def prefill_attn_ms(self, prompt_len: float) -> float:
        m = self.model
        flops = 2 * prompt_len * prompt_len * m.num_heads * m.head_dim  # causal: half of 4 S^2 h d
        return flops / (self.gpu.tflops * 1e12 * self.eff.attn) * 1e3 + self.eff.kernel_launch_ms

    def gpu_decode_ms(self, seqs: float, context_tokens: float) -> float:
        kv = context_tokens * self.model.kv_bytes_per_token_layer()
        return (
            kv / (self.gpu.mem_gbps * 1e9 * self.eff.gpu_mem) * 1e3 + self.eff.kernel_launch_ms + 2e-5 * seqs
        )

    def cpu_decode_ms(self, seqs: float, context_tokens: float) -> float:
        kv = context_tokens * self.host_kv_bytes_per_token_layer()
        return kv / (self.host.mem_gbps * 1e9 * self.eff.cpu_mem) * 1e3 + 1e-4 * seqs

    def transfer_ms(self, nbytes: float) -> float:
        return nbytes / (self.gpu.pcie_gbps * 1e9 * self.eff.pcie) * 1e3 + 0.005

    def transfer_bytes_per_decode(self) -> int:
        m = self.model
        return (2 * m.num_heads + 2 * m.num_kv_heads) * m.head_dim * m.dtype_bytes

    def tables(self, max_tokens: int) -> PerfTables:
        """The predictor's tables, sampled from this model on grids like the engine's profile."""

        def grid(lo: float, hi: float, n: int = 24) -> list[float]:
            return [lo * (hi / lo) ** (i / (n - 1)) for i in range(n)]

        lin = grid(1, max(2, max_tokens))
        pre = grid(1, max(2, self.model.max_len))
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
