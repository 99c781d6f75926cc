"""Configuration: the model's shape parsed from a Hugging Face ``config.json`` (the families of
``ARCHITECTURES``) and the engine's arguments (vLLM's ``EngineArgs`` names)."""

from __future__ import annotations

import dataclasses
import json
import logging
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from neo_rs.errors import InvalidArgumentError, ModelLoadError
from neo_rs.quantized_checkpoint import QUANT_METHODS, QuantizedCheckpoint
from neo_rs.speculative_config import SpeculativeConfig

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Family:
    """What sets an architecture apart from Llama's decoder (``model/decoder.py`` reads it)."""

    qkv_bias: bool = False  # q/k/v carry a bias whatever ``attention_bias`` says (Qwen2)
    o_bias: bool = True  # the O projection has a bias when ``attention_bias`` is set
    qk_norm: str | None = None  # "head": RMSNorm per head (Qwen3); "projection": over all heads (OLMo 2)
    post_norms: bool = False  # norms after attention and the MLP, none before (OLMo 2)
    moe: str | None = None  # "mixtral" | "qwen3_moe": sparse MLP layers (``model/moe.py``)
    # Gemma's decoder: RMSNorm as (1 + w) in float32, embeddings scaled by sqrt(hidden), norms
    # before and after both attention and the MLP.
    gemma: bool = False


# config.json "architectures" -> its family.
ARCHITECTURES = {
    "LlamaForCausalLM": Family(),
    "MistralForCausalLM": Family(o_bias=False),
    "Qwen2ForCausalLM": Family(qkv_bias=True, o_bias=False),
    "Qwen3ForCausalLM": Family(qk_norm="head"),
    "Qwen3MoeForCausalLM": Family(qk_norm="head", moe="qwen3_moe"),
    "MixtralForCausalLM": Family(o_bias=False, moe="mixtral"),
    "Phi3ForCausalLM": Family(o_bias=False),
    "SmolLM3ForCausalLM": Family(),
    "Olmo2ForCausalLM": Family(qk_norm="projection", post_norms=True),
    "Gemma2ForCausalLM": Family(o_bias=False, gemma=True),
    "Gemma3ForCausalLM": Family(o_bias=False, gemma=True, qk_norm="head"),
}
MODEL_TYPES = {
    "llama": "LlamaForCausalLM",
    "mistral": "MistralForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
    "qwen3_moe": "Qwen3MoeForCausalLM",
    "mixtral": "MixtralForCausalLM",
    "phi3": "Phi3ForCausalLM",
    "smollm3": "SmolLM3ForCausalLM",
    "olmo2": "Olmo2ForCausalLM",
    "gemma2": "Gemma2ForCausalLM",
    "gemma3_text": "Gemma3ForCausalLM",
}
# The MLP's activations (its gate's): SwiGLU, or GeGLU with tanh's approximation (Gemma).
ACTIVATIONS = ("silu", "gelu_pytorch_tanh")
OFFLOAD_MODES = ("neo", "none", "all")
DEFAULT_MAX_NUM_BATCHED_TOKENS = 2048
CPU_KV_DTYPES = ("auto", "int8")
# --quantization: int8, int4 and fp8 quantize an unquantized checkpoint's weights at load
# (``model/quant.py``, ``model/fp8.py``); the others keep a checkpoint's own 4-bit weights, and
# are inferred from it: gguf a GGUF's blocks (``model/gguf_blocks.py``), gptq and awq their packed
# tensors (``model/gptq_awq.py``). "none" loads every weight in the model dtype, whatever the
# checkpoint.
CHECKPOINT_QUANTIZATIONS = ("gguf", "gptq", "awq")
QUANTIZATIONS = ("int8", "int4", "fp8", *CHECKPOINT_QUANTIZATIONS)
NO_QUANTIZATION = "none"
DTYPES = {
    "float32": torch.float32,
    "fp32": torch.float32,
    "float16": torch.float16,
    "fp16": torch.float16,
    "half": torch.float16,
    "bfloat16": torch.bfloat16,
    "bf16": torch.bfloat16,
}


@dataclass(frozen=True)
class RopeConfig:
    theta: float = 10000.0
    kind: str = "default"  # default | linear | llama3 | longrope
    factor: float = 1.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192
    # The share of each head's dimensions that rotate (Phi-4-mini: 0.75); the rest pass through.
    partial_rotary_factor: float = 1.0
    # longrope (Phi-3/4): per-frequency divisors below and beyond the original length, and the
    # cos/sin scale.
    short_factor: tuple[float, ...] = ()
    long_factor: tuple[float, ...] = ()
    attention_factor: float = 1.0

    @staticmethod
    def from_hf(cfg: dict[str, Any]) -> RopeConfig:
        # transformers >= 5 writes "rope_parameters" (theta inside); older checkpoints write
        # "rope_theta" and an optional "rope_scaling".
        params = dict(cfg.get("rope_parameters") or cfg.get("rope_scaling") or {})
        theta = float(params.get("rope_theta", cfg.get("rope_theta", 10000.0)))
        partial = float(params.get("partial_rotary_factor", cfg.get("partial_rotary_factor", 1.0)))
        kind = params.get("rope_type", params.get("type", "default"))
        base = RopeConfig(theta=theta, partial_rotary_factor=partial)
        if kind == "default":
            return base
        if kind == "linear":
            return dataclasses.replace(base, kind=kind, factor=float(params["factor"]))
        if kind == "llama3":
            return dataclasses.replace(
                base,
                kind=kind,
                factor=float(params["factor"]),
                low_freq_factor=float(params["low_freq_factor"]),
                high_freq_factor=float(params["high_freq_factor"]),
                original_max_position_embeddings=int(params["original_max_position_embeddings"]),
            )
        if kind == "longrope":
            original = int(
                params.get("original_max_position_embeddings") or cfg["original_max_position_embeddings"]
            )
            # As transformers: the factor defaults to the length ratio, and the cos/sin scale to
            # LongRoPE's sqrt(1 + ln(factor) / ln(original length)).
            factor = float(params.get("factor") or int(cfg["max_position_embeddings"]) / original)
            scale = params.get("attention_factor")
            if scale is None:
                scale = 1.0 if factor <= 1 else math.sqrt(1 + math.log(factor) / math.log(original))
            return dataclasses.replace(
                base,
                kind=kind,
                factor=factor,
                original_max_position_embeddings=original,
                short_factor=tuple(float(f) for f in params["short_factor"]),
                long_factor=tuple(float(f) for f in params["long_factor"]),
                attention_factor=float(scale),
            )
        raise ModelLoadError(
            f"unsupported rope scaling type {kind!r} (supported: default, linear, llama3, longrope)"
        )

    def rotary_dim(self, head_dim: int) -> int:
        """How many of a head's leading dimensions rotate."""
        return int(head_dim * self.partial_rotary_factor)

    def inv_freq(self, head_dim: int, long: bool = False) -> torch.Tensor:
        """Inverse frequencies of the rotary embedding, float32 ``[rotary_dim // 2]``; ``long``:
        longrope's for positions beyond the original length."""
        dim = self.rotary_dim(head_dim)
        exponents = torch.arange(0, dim, 2, dtype=torch.int64).float() / dim
        if self.kind == "longrope":
            factors = self.long_factor if long else self.short_factor
            if len(factors) != dim // 2:
                raise ModelLoadError(f"longrope has {len(factors)} factors for {dim // 2} frequencies")
            return 1.0 / (torch.tensor(factors, dtype=torch.float32) * self.theta**exponents)
        inv = 1.0 / (self.theta**exponents)
        if self.kind == "linear":
            return inv / self.factor
        if self.kind == "llama3":
            low_wavelen = self.original_max_position_embeddings / self.low_freq_factor
            high_wavelen = self.original_max_position_embeddings / self.high_freq_factor
            wavelen = 2 * math.pi / inv
            scaled = torch.where(wavelen > low_wavelen, inv / self.factor, inv)
            smooth = (self.original_max_position_embeddings / wavelen - self.low_freq_factor) / (
                self.high_freq_factor - self.low_freq_factor
            )
            smoothed = (1 - smooth) * scaled / self.factor + smooth * scaled
            medium = ~(wavelen < high_wavelen) * ~(wavelen > low_wavelen)
            return torch.where(medium, smoothed, scaled)
        return inv

    def angles(self, head_dim: int, positions: int) -> torch.Tensor:
        """Rotation angles ``[positions, rotary_dim // 2]``, float32. longrope takes its long
        factors from the original length on, per position (transformers switches the whole
        sequence once it grows past that length; below it, the two agree)."""
        pos = torch.arange(positions, dtype=torch.float32)
        freqs = torch.outer(pos, self.inv_freq(head_dim))
        if self.kind == "longrope" and positions > self.original_max_position_embeddings:
            beyond = slice(self.original_max_position_embeddings, None)
            freqs[beyond] = torch.outer(pos[beyond], self.inv_freq(head_dim, long=True))
        return freqs


@dataclass(frozen=True)
class AttentionKind:
    """How one layer attends: the softmax scale; a sliding window (a row attends to its last
    ``window`` positions, its own included; None: to all); soft-capping of the scaled scores
    (``softcap · tanh(score / softcap)`` before the softmax; None: none)."""

    scale: float
    window: int | None = None
    softcap: float | None = None


@dataclass(frozen=True)
class MoeConfig:
    """A sparse MLP: ``num_experts`` SwiGLU experts of ``intermediate_size``, ``top_k`` per token."""

    num_experts: int
    top_k: int
    intermediate_size: int
    # Renormalise the chosen experts' softmax weights to sum to 1 (Mixtral always does).
    norm_topk_prob: bool
    layers: tuple[bool, ...]  # per layer: sparse (True) or the dense MLP


@dataclass(frozen=True)
class ModelConfig:
    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope: RopeConfig
    max_position_embeddings: int
    qkv_bias: bool
    tie_word_embeddings: bool
    torch_dtype: torch.dtype
    sliding_window: int | None = None
    # Per layer, whether it slides (None: every layer, when there is a window).
    sliding_layers: tuple[bool, ...] | None = None
    attn_softcap: float | None = None  # soft-capping of attention scores (Gemma 2)
    query_pre_attn_scalar: float | None = None  # scores scaled by its -1/2 power, not head_dim's (Gemma)
    o_bias: bool = False
    qk_norm: str | None = None  # see ``Family``
    post_norms: bool = False
    rope_layers: tuple[bool, ...] | None = None  # per layer, whether RoPE applies (None: all; SmolLM3)
    moe: MoeConfig | None = None
    hidden_act: str = "silu"  # one of ACTIVATIONS
    gemma: bool = False  # see ``Family``
    local_rope: RopeConfig | None = None  # the sliding layers' RoPE where it differs (Gemma 3)
    final_softcap: float | None = None  # soft-capping of the logits (Gemma 2)
    gguf_file: str | None = None  # the GGUF file the checkpoint was converted from (``gguf.py``)
    quantized_checkpoint: QuantizedCheckpoint | None = None  # its linears as GPTQ, AWQ or FP8 tensors

    @staticmethod
    def from_dir(model_dir: str | Path) -> ModelConfig:
        path = Path(model_dir) / "config.json"
        if not path.is_file():
            raise ModelLoadError(f"{model_dir}: no config.json (expected a Hugging Face model directory)")
        try:
            cfg = json.loads(path.read_text())
        except json.JSONDecodeError as e:
            raise ModelLoadError(f"{path}: invalid JSON ({e})") from e
        return ModelConfig.from_hf(cfg, str(path))

    @staticmethod
    def from_hf(cfg: dict[str, Any], where: str = "config.json") -> ModelConfig:
        archs = cfg.get("architectures") or [MODEL_TYPES.get(cfg.get("model_type", ""), "")]
        arch = archs[0]
        if arch not in ARCHITECTURES:
            raise ModelLoadError(
                f"{where}: unsupported architecture {arch or cfg.get('model_type')!r} "
                f"(supported: {', '.join(ARCHITECTURES)})"
            )
        family = ARCHITECTURES[arch]
        quant = cfg.get("quantization_config")
        method = quant.get("quant_method") if isinstance(quant, dict) else quant
        if quant is not None and (not isinstance(quant, dict) or method not in ("gguf", *QUANT_METHODS)):
            raise ModelLoadError(
                f"{where}: quantization_config {method!r} is not supported yet (we load "
                f"{', '.join(QUANT_METHODS)}); load an unquantized checkpoint, optionally with "
                "--quantization int8, int4 or fp8"
            )
        packed = QuantizedCheckpoint.from_hf(quant, where) if quant is not None and method != "gguf" else None
        try:
            heads = int(cfg["num_attention_heads"])
            hidden = int(cfg["hidden_size"])
            layers = int(cfg["num_hidden_layers"])
            act = cfg.get("hidden_activation") or cfg.get("hidden_act") or "silu"
            if act not in ACTIVATIONS:
                supported = ", ".join(ACTIVATIONS)
                raise ModelLoadError(
                    f"{where}: unsupported activation {act!r} for {arch} (supported: {supported})"
                )
            rope, local_rope = _ropes(cfg)
            window = cfg.get("sliding_window") if cfg.get("use_sliding_window", True) else None
            sliding = _sliding_layers(cfg, layers) if window else None
            bias = bool(cfg.get("attention_bias", False))
            no_rope = cfg.get("no_rope_layers")  # SmolLM3: 1 where RoPE applies
            return ModelConfig(
                architecture=arch,
                vocab_size=int(cfg["vocab_size"]),
                hidden_size=hidden,
                intermediate_size=int(cfg["intermediate_size"]),
                num_layers=layers,
                num_heads=heads,
                num_kv_heads=int(cfg.get("num_key_value_heads") or heads),
                head_dim=int(cfg.get("head_dim") or hidden // heads),
                rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
                rope=rope,
                max_position_embeddings=int(cfg.get("max_position_embeddings", 2048)),
                qkv_bias=family.qkv_bias or bias,
                tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
                torch_dtype=DTYPES.get(
                    str(cfg.get("torch_dtype") or cfg.get("dtype") or "float32"), torch.float32
                ),
                sliding_window=int(window) if window else None,
                sliding_layers=sliding,
                attn_softcap=_positive(cfg.get("attn_logit_softcapping")),
                query_pre_attn_scalar=_positive(cfg.get("query_pre_attn_scalar")),
                o_bias=family.o_bias and bias,
                qk_norm=family.qk_norm,
                post_norms=family.post_norms,
                rope_layers=tuple(bool(r) for r in no_rope) if no_rope is not None else None,
                moe=_moe_config(family.moe, cfg, layers),
                hidden_act=act,
                gemma=family.gemma,
                local_rope=local_rope,
                final_softcap=_positive(cfg.get("final_logit_softcapping")),
                gguf_file=quant["file"] if quant is not None and method == "gguf" else None,
                quantized_checkpoint=packed,
            )
        except KeyError as e:
            raise ModelLoadError(f"{where}: missing field {e.args[0]!r}") from e

    def max_model_len(self) -> int:
        """The longest context the model supports."""
        return self.max_position_embeddings

    def attention_kinds(self) -> list[AttentionKind]:
        """How each layer attends (``AttentionKind``)."""
        scale = (self.query_pre_attn_scalar or self.head_dim) ** -0.5
        slides = self.sliding_layers or (True,) * self.num_layers
        return [
            AttentionKind(
                scale, self.sliding_window if self.sliding_window and s else None, self.attn_softcap
            )
            for s in slides
        ]


def _ropes(cfg: dict[str, Any]) -> tuple[RopeConfig, RopeConfig | None]:
    """The RoPE of the global layers, and the sliding layers' where it differs: transformers 5
    writes one per layer type (``rope_parameters`` by ``full_attention``/``sliding_attention``),
    Gemma 3's older configs a ``rope_local_base_freq``."""
    params = cfg.get("rope_parameters") or {}
    if "full_attention" in params:
        full = params["full_attention"]
        rope = RopeConfig.from_hf({**cfg, "rope_parameters": full})
        local = RopeConfig.from_hf({**cfg, "rope_parameters": params.get("sliding_attention") or full})
    else:
        rope = RopeConfig.from_hf(cfg)
        theta = cfg.get("rope_local_base_freq")
        local = (
            RopeConfig(theta=float(theta), partial_rotary_factor=rope.partial_rotary_factor)
            if theta
            else rope
        )
    return rope, local if local != rope else None


def _positive(x: Any) -> float | None:
    """An optional positive number of a config (absent, null or 0: None)."""
    return float(x) if x else None


def _sliding_layers(cfg: dict[str, Any], layers: int) -> tuple[bool, ...]:
    """Which layers slide: as ``layer_types`` says where given (transformers writes it for
    hybrid models), else Qwen2's ``max_window_layers`` (the layers from it on), else all."""
    if types := cfg.get("layer_types"):
        if len(types) != layers:
            raise ModelLoadError(f"layer_types names {len(types)} layers, the model has {layers}")
        return tuple(t == "sliding_attention" for t in types)
    if "max_window_layers" in cfg:
        return tuple(i >= int(cfg["max_window_layers"]) for i in range(layers))
    return (True,) * layers


def _moe_config(kind: str | None, cfg: dict[str, Any], layers: int) -> MoeConfig | None:
    """The sparse MLP of a ``Family.moe`` kind, from transformers' config names."""
    if kind is None:
        return None
    # Qwen3-MoE's checkpoints say num_experts; transformers 5 saves either as num_local_experts.
    experts = int(cfg.get("num_local_experts") or cfg["num_experts"])
    if kind == "mixtral":
        size, norm = int(cfg["intermediate_size"]), True
        sparse = (True,) * layers
    else:
        size = int(cfg["moe_intermediate_size"])
        norm = bool(cfg.get("norm_topk_prob", False))
        step, dense = int(cfg.get("decoder_sparse_step", 1)), set(cfg.get("mlp_only_layers") or [])
        sparse = tuple(i not in dense and experts > 0 and (i + 1) % step == 0 for i in range(layers))
    top_k = int(cfg["num_experts_per_tok"])
    if not 0 < top_k <= experts:
        raise ModelLoadError(f"num_experts_per_tok {top_k} must be between 1 and the {experts} experts")
    return MoeConfig(experts, top_k, size, norm, sparse)


def resolve_dtype(
    name: str | torch.dtype, auto: torch.dtype, capability: tuple[int, int] | None = None
) -> torch.dtype:
    """``name`` as a torch dtype; ``auto`` is what "auto" stands for (the checkpoint's dtype).
    ``capability``: the CUDA device's, if the model runs on one. A GPU before sm_80 (a T4, a V100)
    has no bfloat16, so there, as in vLLM, "auto" takes float16 for a bfloat16 checkpoint (and
    says so once), and an explicit bfloat16 is refused."""
    no_bf16 = capability is not None and capability < (8, 0)
    if isinstance(name, torch.dtype):
        dtype = name
    elif name == "auto":
        if auto == torch.bfloat16 and no_bf16:
            log.warning("compute capability %s has no bfloat16: the checkpoint runs in float16", capability)
            return torch.float16
        return auto
    elif name not in DTYPES:
        raise InvalidArgumentError(f"dtype must be auto, float32, float16 or bfloat16, got {name!r}")
    else:
        dtype = DTYPES[name]
    if dtype == torch.bfloat16 and no_bf16:
        raise InvalidArgumentError(
            f"dtype bfloat16 needs a GPU of compute capability 8.0 or later; this one is {capability}: "
            "use float16"
        )
    return dtype


@dataclass
class EngineArgs:
    """Everything the engine needs besides the model directory; vLLM's names and defaults."""

    model: str | None = None  # a directory, a .gguf file or a built-in name; None: the demo model
    dtype: str = "auto"
    device: str | None = None  # None: cuda when available, else cpu
    max_model_len: int | None = None
    max_num_seqs: int = 256
    max_num_batched_tokens: int | None = None
    block_size: int = 16
    num_gpu_blocks: int | None = None
    gpu_memory_utilization: float = 0.9
    num_cpu_blocks: int | None = None
    cpu_kv_gib: float = 4.0
    # The host pool's storage: "auto" (the model dtype) or "int8" (a scale per token and KV
    # head; half the bytes of bf16 for the CPU attention to read, twice the tokens per GiB).
    cpu_kv_dtype: str = "auto"
    cpu_threads: int | None = None
    # neo: partial offload with the asymmetric pipeline; none: GPU-only (overflow swapped);
    # all: every decode on the CPU.
    offload: str = "none"
    neo_force_pipeline: bool = False  # tests: pipeline every CPU decode whatever the estimates
    # Reuse the device KV of full blocks a prompt shares with earlier ones (vLLM's automatic
    # prefix caching, on by default as in vLLM v1).
    enable_prefix_caching: bool = True
    # The host tier of the prefix cache: this much of the host pool keeps prefix blocks the
    # device cache evicts, for later prompts to copy back instead of recomputing. None: a
    # quarter of the host pool. The tier's blocks stay free room: swap-outs and CPU decodes
    # take them first when no clean block is left.
    cpu_prefix_cache_gib: float | None = None
    seed: int = 0
    skip_tokenizer_init: bool = False
    # Ranks the model is split over (Megatron-style, ``neo_rs.parallel``): the engine starts
    # ranks 1..N-1 itself. Each rank holds its heads' KV in its own pools (``cpu_kv_gib`` is per
    # rank) and gets an equal share of the host's cores.
    tensor_parallel_size: int = 1
    # Decode-only iterations replayed from CUDA graphs (worker/graphs.py); off by default until a
    # GPU run has validated them. On a CPU device, iterations over the device pool alone run the
    # decoder stack compiled by Inductor (worker/compiled.py). ``enforce_eager`` (vLLM's name) says neither;
    # None: compile unless NEO_RS_ENFORCE_EAGER=1 (the test suite's default).
    cuda_graphs: bool = False
    enforce_eager: bool | None = None
    # Weights kept quantized: one of QUANTIZATIONS, "none", or None (inferred from the checkpoint:
    # a GGUF's blocks, GPTQ or AWQ tensors are kept, see ``quantization_for``).
    quantization: str | None = None
    # vLLM's speculative config (a dict, or its JSON text): ``{"method": "ngram",
    # "num_speculative_tokens": k, "prompt_lookup_min": a, "prompt_lookup_max": b}``, or
    # ``{"method": "draft_model", "model": PATH, "num_speculative_tokens": k}``.
    speculative_config: SpeculativeConfig | dict[str, Any] | str | None = None

    @property
    def token_budget(self) -> int:
        """Tokens one iteration may run (``max_num_batched_tokens``, or the default)."""
        return self.max_num_batched_tokens or DEFAULT_MAX_NUM_BATCHED_TOKENS

    def quantization_for(self, cfg: ModelConfig) -> str | None:
        """The method the weights are kept in: the one asked for, else the checkpoint's own (a
        GGUF's blocks, GPTQ, AWQ or FP8 tensors); None: the model dtype."""
        own = (
            "gguf"
            if cfg.gguf_file is not None
            else cfg.quantized_checkpoint and cfg.quantized_checkpoint.method
        )
        asked = self.quantization
        if asked in CHECKPOINT_QUANTIZATIONS and asked != own:
            source = {"gguf": "a .gguf model", "gptq": "a GPTQ checkpoint", "awq": "an AWQ checkpoint"}
            raise InvalidArgumentError(f"quantization {asked!r} needs {source[asked]}")
        if cfg.quantized_checkpoint is not None and asked in ("int8", "int4", "fp8") and asked != own:
            raise InvalidArgumentError(
                f"the checkpoint is {own}-quantized: quantization must be {own!r}, 'none' or unset"
            )
        if self.quantization is None:
            return own or None
        return None if self.quantization == NO_QUANTIZATION else self.quantization

    @property
    def speculation(self) -> SpeculativeConfig | None:
        return None if self.speculative_config is None else SpeculativeConfig.parse(self.speculative_config)

    @property
    def max_sampled_rows(self) -> int:
        """Rows one iteration may sample: one per sequence, and one per draft it verifies."""
        spec = self.speculation
        return self.max_num_seqs * (1 + (spec.num_speculative_tokens if spec is not None else 0))

    def validate(self) -> None:
        if self.speculative_config is not None:
            SpeculativeConfig.parse(self.speculative_config)  # its errors before anything is built
        if self.max_num_seqs < 1:
            raise InvalidArgumentError(f"max_num_seqs must be at least 1, got {self.max_num_seqs}")
        if self.block_size not in (8, 16, 32):
            raise InvalidArgumentError(f"block_size must be 8, 16 or 32, got {self.block_size}")
        if not 0 < self.gpu_memory_utilization <= 1:
            raise InvalidArgumentError(
                f"gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization}"
            )
        if self.num_gpu_blocks is not None and self.num_gpu_blocks < 1:
            raise InvalidArgumentError(f"num_gpu_blocks must be at least 1, got {self.num_gpu_blocks}")
        if self.num_cpu_blocks is not None and self.num_cpu_blocks < 0:
            raise InvalidArgumentError(f"num_cpu_blocks must be non-negative, got {self.num_cpu_blocks}")
        if self.max_num_batched_tokens is not None and self.max_num_batched_tokens < 1:
            raise InvalidArgumentError("max_num_batched_tokens must be at least 1")
        if self.offload not in OFFLOAD_MODES:
            raise InvalidArgumentError(
                f"offload must be one of {', '.join(OFFLOAD_MODES)}, got {self.offload!r}"
            )
        if self.cpu_kv_dtype not in CPU_KV_DTYPES:
            raise InvalidArgumentError(
                f"cpu_kv_dtype must be one of {', '.join(CPU_KV_DTYPES)}, got {self.cpu_kv_dtype!r}"
            )
        if self.tensor_parallel_size < 1:
            raise InvalidArgumentError(
                f"tensor_parallel_size must be at least 1, got {self.tensor_parallel_size}"
            )
        if self.cuda_graphs and self.enforce_eager:
            raise InvalidArgumentError("cuda_graphs and enforce_eager contradict each other: pick one")
        if self.quantization not in (None, NO_QUANTIZATION, *QUANTIZATIONS):
            raise InvalidArgumentError(
                f"quantization must be one of {', '.join((*QUANTIZATIONS, NO_QUANTIZATION))}, "
                f"got {self.quantization!r}"
            )
        if self.cpu_kv_gib < 0:
            raise InvalidArgumentError(f"cpu_kv_gib must be non-negative, got {self.cpu_kv_gib}")
        if self.cpu_prefix_cache_gib is not None and not self.cpu_prefix_cache_gib >= 0:
            raise InvalidArgumentError(
                f"cpu_prefix_cache_gib must be non-negative, got {self.cpu_prefix_cache_gib}"
            )
