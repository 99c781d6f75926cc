"""The model runner: owns the weights, both KV pools and the attention backends, applies a
plan's swaps and runs its forward pass (one batch, every layer's three stages in order; CPU
decodes attend over the host pool, finishing host-bound prefills are copied there layer by layer)
up to the logits of the sampled rows."""

from __future__ import annotations

import logging
from pathlib import Path

import numpy as np
import torch

from neo_rs._core import CpuAttention, SchedulerOutput
from neo_rs.attention import Attention, AttentionBatch
from neo_rs.config import EngineArgs, ModelConfig
from neo_rs.errors import InvalidArgumentError
from neo_rs.kv_cache import KvLayout, KvPool, block_pairs, copy_blocks
from neo_rs.model import load_model

log = logging.getLogger(__name__)

# Device pool budget when the "device" is the CPU and no block count is given.
_CPU_DEVICE_KV_BYTES = 2 << 30


def resolve_device(name: str | None) -> torch.device:
    if name is None:
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dev = torch.device(name)
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise InvalidArgumentError("device 'cuda' was asked for, but CUDA is not available")
    if dev.type not in ("cuda", "cpu"):
        raise InvalidArgumentError(f"device must be cuda or cpu, got {name!r}")
    return dev


class ModelRunner:
    def __init__(
        self,
        args: EngineArgs,
        model_dir: Path,
        cfg: ModelConfig,
        dtype: torch.dtype,
        device: torch.device,
        max_model_len: int,
    ) -> None:
        self.device = device
        self.model = load_model(model_dir, cfg, dtype, device, max_model_len)
        self.layout = KvLayout(cfg.num_layers, cfg.num_kv_heads, args.block_size, cfg.head_dim, dtype)
        per_block = self.layout.bytes_per_block()
        num_gpu = args.num_gpu_blocks or self._device_blocks(args, max_model_len)
        num_cpu = (
            args.num_cpu_blocks
            if args.num_cpu_blocks is not None
            else int(args.cpu_kv_gib * (1 << 30)) // per_block
        )
        self.device_pool = KvPool(self.layout, num_gpu, device)
        self.host_pool = KvPool(self.layout, num_cpu, torch.device("cpu"))
        log.info(
            "KV pools: %d device blocks (%.2f GiB), %d host blocks (%.2f GiB), %d tokens per block",
            num_gpu,
            num_gpu * per_block / (1 << 30),
            num_cpu,
            num_cpu * per_block / (1 << 30),
            args.block_size,
        )
        self.attention = Attention(cfg.head_dim**-0.5, CpuAttention(num_threads=args.cpu_threads))

    def _device_blocks(self, args: EngineArgs, max_model_len: int) -> int:
        per_block = self.layout.bytes_per_block()
        if self.device.type == "cuda":
            free, total = torch.cuda.mem_get_info(self.device)
            # Leave (1 - utilization) of the card, plus room for activations of one batch.
            budget = free - (1 - args.gpu_memory_utilization) * total - (1 << 30)
        else:
            wanted = args.max_num_seqs * -(-max_model_len // args.block_size) * per_block
            budget = min(wanted, _CPU_DEVICE_KV_BYTES)
        blocks = int(budget // per_block)
        if blocks < 1:
            raise InvalidArgumentError(
                "no device memory is left for the KV cache; "
                "use a smaller model or raise gpu_memory_utilization"
            )
        return blocks

    @property
    def num_gpu_blocks(self) -> int:
        return self.device_pool.num_blocks

    @property
    def num_cpu_blocks(self) -> int:
        return self.host_pool.num_blocks

    def apply_swaps(self, plan: SchedulerOutput) -> None:
        """Whole-request moves between the pools, swap-outs first (their blocks may be reused)."""
        dev, host = self.device_pool, self.host_pool
        copy_blocks(dev, host, *block_pairs(plan.swap_out, dev, host))
        copy_blocks(host, dev, *block_pairs(plan.swap_in, host, dev))

    @torch.inference_mode()
    def execute(self, plan: SchedulerOutput) -> torch.Tensor:
        """Run the plan's tokens through the model; float32 logits of its sampled rows."""
        dev = self.device
        model = self.model
        ids = torch.from_numpy(plan.input_ids).to(dev)
        positions = torch.from_numpy(plan.positions).to(dev)
        batch = AttentionBatch.from_plan(plan, dev, self.layout.block_size)
        pool, host = self.device_pool, self.host_pool
        rows = batch.device_rows(len(ids))
        to_host = block_pairs(plan.prefill_to_host, pool, host)
        x = model.embed_tokens(ids)
        for i, layer in enumerate(model.decoder_layers):
            q, k, v = layer.pre_attention(x, positions, model.rotary)
            for r in rows:
                pool.write(i, batch.slot_mapping[r], k[r], v[r])
            # Finishing prefills bound for the host pool leave this layer's blocks right away.
            copy_blocks(pool, host, *to_host, layer=i)
            attn = self.attention.forward(q, k, v, pool, host, i, batch)
            x = layer.post_attention(attn, x)
        sample_rows = torch.from_numpy(np.ascontiguousarray(plan.sample_rows)).to(dev)
        return model.compute_logits(x[sample_rows])
