"""Hardware and model profiles. GPU figures are dense FP16/BF16 tensor throughput and memory
bandwidth from NVIDIA's datasheets; host figures are the instances' memory and an effective
read bandwidth that grows with the instance's share of its socket (the paper's finding: NEO's gain
tracks host memory bandwidth). Users add their own from a JSON (or TOML) file."""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any

from neo_rs.parallel.shards import rank_shapes


@dataclass(frozen=True)
class GpuProfile:
    name: str
    mem_gib: float
    mem_gbps: float  # HBM/GDDR bandwidth
    tflops: float  # dense FP16/BF16 tensor
    pcie_gbps: float  # effective host<->device copy bandwidth
    count: int = 1  # tensor-parallel GPUs the model is split over (the figures above are their sum)
    link_gbps: float = 0.0  # GPU-to-GPU bandwidth per direction, per GPU (the all-reduces)
    source: str = ""

    def rank(self) -> GpuProfile:
        """One of the ``count`` GPUs."""
        n = self.count
        return dataclasses.replace(
            self,
            mem_gib=self.mem_gib / n,
            mem_gbps=self.mem_gbps / n,
            tflops=self.tflops / n,
            pcie_gbps=self.pcie_gbps / n,
            count=1,
        )


@dataclass(frozen=True)
class HostProfile:
    name: str
    vcpus: int
    mem_gib: float
    mem_gbps: float  # effective read bandwidth available to the instance
    source: str = ""


@dataclass(frozen=True)
class ModelProfile:
    name: str
    num_layers: int
    hidden: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    ffn: int
    vocab: int
    max_len: int = 8192
    dtype_bytes: int = 2
    # Mixture of experts: ``experts`` SwiGLU experts of ``ffn`` columns each, ``experts_per_token``
    # of them per token (0: a dense MLP of ``ffn`` columns).
    experts: int = 0
    experts_per_token: int = 0
    # Bits the decoder layers' weights take each (``--weights``; None: the model dtype's); the
    # embeddings and the LM head stay in the dtype.
    weight_bits: float | None = None

    def _attn_params(self) -> int:
        qkv = self.hidden * (self.num_heads + 2 * self.num_kv_heads) * self.head_dim
        return qkv + self.num_heads * self.head_dim * self.hidden

    def layer_params(self) -> int:
        """Every weight of one layer (what memory holds)."""
        return (
            self._attn_params()
            + max(1, self.experts) * 3 * self.hidden * self.ffn
            + self.experts * self.hidden
        )

    def active_layer_params(self) -> int:
        """The weights one token multiplies in one layer (its FLOPs are twice this)."""
        return self._attn_params() + max(1, self.experts_per_token) * 3 * self.hidden * self.ffn

    def read_layer_params(self, tokens: float) -> float:
        """The weights ``tokens`` tokens read in one layer: with experts, those of the experts
        any of them routes to (uniform routing: each expert is missed with probability
        ``(1 - k / experts) ** tokens``)."""
        if not self.experts:
            return self.layer_params()
        touched = self.experts * (1 - (1 - self.experts_per_token / self.experts) ** tokens)
        return self._attn_params() + touched * 3 * self.hidden * self.ffn + self.experts * self.hidden

    def layer_weight_bytes(self) -> float:
        """Bytes per decoder-layer weight."""
        return self.dtype_bytes if self.weight_bits is None else self.weight_bits / 8

    def weight_bytes(self) -> int:
        layers = self.num_layers * self.layer_params() * self.layer_weight_bytes()
        return int(layers + 2 * self.vocab * self.hidden * self.dtype_bytes)

    def kv_bytes_per_token_layer(self) -> int:
        return 2 * self.num_kv_heads * self.head_dim * self.dtype_bytes

    def shard(self, size: int) -> ModelProfile:
        """One tensor-parallel rank's part, split as the engine splits it (``rank_shapes``)."""
        shapes = rank_shapes(size, self.num_heads, self.num_kv_heads, self.ffn, self.vocab)
        heads, kv_heads, ffn, vocab = shapes
        return dataclasses.replace(self, num_heads=heads, num_kv_heads=kv_heads, ffn=ffn, vocab=vocab)


# --weights: bits per decoder-layer weight, scales included (int8 and fp8: one per output row,
# next to nothing; int4: a 16-bit scale and zero per group of 128 weights).
WEIGHT_BITS = {"int8": 8.0, "fp8": 8.0, "int4": 4.0 + 32 / 128}

GPUS = {
    g.name: g
    for g in (
        GpuProfile(
            "T4", 16, 320, 65, 12, source="NVIDIA T4 datasheet: 16 GB GDDR6, 320 GB/s, 65 TFLOPS FP16"
        ),
        GpuProfile(
            "A10G", 24, 600, 70, 25, source="AWS G5 / NVIDIA A10G: 24 GB, 600 GB/s, ~70 TFLOPS FP16 dense"
        ),
        GpuProfile(
            "L4", 24, 300, 121, 25, source="NVIDIA L4 datasheet: 24 GB, 300 GB/s, 121 TFLOPS FP16 dense"
        ),
        GpuProfile(
            "A100-80G", 80, 2039, 312, 25, source="NVIDIA A100 datasheet: 80 GB HBM2e, 2039 GB/s, 312 TFLOPS"
        ),
        GpuProfile(
            "H100", 80, 3350, 989, 50, source="NVIDIA H100 SXM datasheet: 80 GB, 3.35 TB/s, 989 TFLOPS dense"
        ),
        GpuProfile(
            "H200", 141, 4800, 989, 50, source="NVIDIA H200 datasheet: 141 GB HBM3e, 4.8 TB/s, 989 TFLOPS"
        ),
        GpuProfile(
            "2xH100",
            160,
            6700,
            1978,
            100,
            count=2,
            link_gbps=450,
            source="two H100 SXM, tensor parallel over NVLink 4 (900 GB/s both ways per GPU)",
        ),
    )
}

HOSTS = {
    h.name: h
    for h in (
        HostProfile("g4dn.4xlarge", 16, 64, 50, source="AWS g4dn: Xeon 8259CL, 16 vCPU of 96, 64 GiB"),
        HostProfile(
            "g5.2xlarge", 8, 32, 25, source="AWS g5: EPYC 7R32 (8 ch DDR4-3200, 205 GB/s/socket), 8 vCPU"
        ),
        HostProfile("g5.4xlarge", 16, 64, 45, source="AWS g5.4xlarge: 16 vCPU, 64 GiB"),
        HostProfile("g5.8xlarge", 32, 128, 85, source="AWS g5.8xlarge: 32 vCPU, 128 GiB"),
        HostProfile("g5.16xlarge", 64, 256, 150, source="AWS g5.16xlarge: 64 vCPU, 256 GiB"),
        HostProfile("server", 64, 512, 200, source="a 2-socket DDR4/DDR5 server, ~200 GB/s effective"),
    )
}

MODELS = {
    m.name: m
    for m in (
        ModelProfile("llama-2-7b", 32, 4096, 32, 32, 128, 11008, 32000, 4096),
        ModelProfile("llama-3-8b", 32, 4096, 32, 8, 128, 14336, 128256, 8192),
        ModelProfile("llama-3-70b", 80, 8192, 64, 8, 128, 28672, 128256, 8192),
        # Qwen3-30B-A3B and Mixtral-8x7B config.json: 30.5B and 46.7B weights, 3.3B and 12.9B active.
        ModelProfile(
            "qwen3-30b-a3b", 48, 2048, 32, 4, 128, 768, 151936, 32768, experts=128, experts_per_token=8
        ),
        ModelProfile(
            "mixtral-8x7b", 32, 4096, 32, 8, 128, 14336, 32000, 32768, experts=8, experts_per_token=2
        ),
    )
}


def _build(cls: type, d: dict[str, Any]) -> Any:
    known = {f.name for f in fields(cls)}
    unknown = set(d) - known
    if unknown:
        raise ValueError(f"unknown {cls.__name__} fields: {', '.join(sorted(unknown))}")
    return cls(**d)


def load_profiles(path: Path) -> None:
    """Add ``[gpu.NAME]`` / ``[host.NAME]`` / ``[model.NAME]`` tables (or JSON objects) to the
    built-in profiles."""
    text = path.read_text()
    if path.suffix == ".toml":
        import tomllib  # Python >= 3.11; JSON works everywhere

        data = tomllib.loads(text)
    else:
        data = json.loads(text)
    for kind, table, cls in (
        ("gpu", GPUS, GpuProfile),
        ("host", HOSTS, HostProfile),
        ("model", MODELS, ModelProfile),
    ):
        for name, d in data.get(kind, {}).items():
            table[name] = _build(cls, {"name": name, **d})
