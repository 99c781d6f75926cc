"""Calibration: the efficiency factors that make the cost model reproduce stage times measured
on real hardware (the engine's start-up profile, cached in ``~/.cache/neo_rs/profiles``). Each
factor is the share of the datasheet peak that the largest measured point of its stage reached,
where that stage is bound by that peak."""

from __future__ import annotations

import dataclasses

from neo_rs.config import ModelConfig
from neo_rs.sim.cost import CostModel, Efficiency
from neo_rs.sim.profiles import ModelProfile
from neo_rs.worker.profiler import PerfTables


def model_profile(cfg: ModelConfig, name: str, dtype_bytes: int) -> ModelProfile:
    """The simulator's view of a Hugging Face model directory's shape."""
    # A sparse model's experts stand for its MLP (its few dense layers are counted as sparse).
    ffn = cfg.moe.intermediate_size if cfg.moe else cfg.intermediate_size
    return ModelProfile(
        name,
        cfg.num_layers,
        cfg.hidden_size,
        cfg.num_heads,
        cfg.num_kv_heads,
        cfg.head_dim,
        ffn,
        cfg.vocab_size,
        cfg.max_model_len(),
        dtype_bytes,
        experts=cfg.moe.num_experts if cfg.moe else 0,
        experts_per_token=cfg.moe.top_k if cfg.moe else 0,
    )


def _share(work: float, peak_per_s: float, measured_ms: float) -> float:
    """Achieved / peak, clamped to a sane range."""
    return min(1.0, max(0.01, work / (peak_per_s * measured_ms / 1e3)))


def fit(cost: CostModel, tables: PerfTables) -> Efficiency:
    m, gpu, host = cost.rank_model, cost.rank_gpu, cost.rank_host
    kv = m.kv_bytes_per_token_layer()
    tokens, linear_ms = tables.linear[0][-1], tables.linear[1][-1]
    prompt, prefill_ms = tables.prefill_attn[0][-1], tables.prefill_attn[1][-1]
    g_cols, g_vals = tables.gpu_decode[1], tables.gpu_decode[2]
    c_cols, c_vals = tables.cpu_decode[1], tables.cpu_decode[2]
    nbytes, transfer_ms = tables.transfer[0][-1], tables.transfer[1][-1]
    return dataclasses.replace(
        cost.eff,
        gemm=_share(2 * tokens * m.active_layer_params(), gpu.tflops * 1e12, linear_ms),
        attn=_share(2 * prompt * prompt * m.num_heads * m.head_dim, gpu.tflops * 1e12, prefill_ms),
        # One sequence over the most tokens: the first row's last column.
        gpu_mem=_share(g_cols[-1] * kv, gpu.mem_gbps * 1e9, g_vals[len(g_cols) - 1]),
        cpu_mem=_share(c_cols[-1] * kv, host.mem_gbps * 1e9, c_vals[len(c_cols) - 1]),
        pcie=_share(nbytes, gpu.pcie_gbps * 1e9, transfer_ms),
        cpu_handoff_ms=tables.launch_ms,
    )
