"""GGUF checkpoints (llama.cpp's format), read with the ``gguf`` package and converted once into a
Hugging Face checkpoint directory under the cache dir: ``config.json`` from the metadata, the
tokenizer and chat template through transformers' GGUF tokenizer conversion, and the weights
dequantized into the model dtype with llama.cpp's Q/K row permutation undone and its stacked
expert tensors split per expert; config.json names the file, whose 4-bit blocks the engine may
keep instead (``gguf_blocks.py``). Llama 3.1's per-frequency rope factors (``rope_freqs.weight``)
become the ``llama3`` rope parameters that reproduce them, Phi-3's long and short factors its
``longrope`` parameters. Gemma's norms come back as HF keeps them (llama.cpp stores ``1 + w``), and
what llama.cpp hardcodes for Gemma (its layer pattern, attention scale, local RoPE base) is
written out. The engine then loads that directory like any other, and a second start finds it
cached."""

from __future__ import annotations

import hashlib
import json
import logging
import math
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import torch
from tqdm import tqdm

from neo_rs.config import DTYPES, MODEL_TYPES, RopeConfig
from neo_rs.environment import build_atomically, cache_dir
from neo_rs.errors import ModelLoadError

log = logging.getLogger(__name__)

# Bump when the conversion's output changes, so stale cached directories are not reused.
CONVERTER_VERSION = 4
# GGUF architecture -> transformers' model_type.
GGUF_MODEL_TYPES = {
    "llama": "llama",
    "qwen2": "qwen2",
    "qwen3": "qwen3",
    "qwen3moe": "qwen3_moe",
    "phi3": "phi3",
    "gemma2": "gemma2",
    "gemma3": "gemma3_text",
}
# The model types whose Q/K rows llama.cpp's converter permuted (rotate-half -> interleaved).
PERMUTED_QK = {"llama"}
# The types the ``gguf`` package dequantizes that llama.cpp emits for these models' weights.
QUANT_TYPES = "F32 F16 BF16 Q8_0 Q4_0 Q4_1 Q5_0 Q5_1 Q2_K Q3_K Q4_K Q5_K Q6_K".split()
_GLOBAL_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_LAYER_NAMES = {
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "ffn_gate_inp": "mlp.gate",
}
# Where an architecture names a layer tensor otherwise: Gemma's four norms, Phi-3's fused
# projections.
_GEMMA_NAMES = {
    "post_attention_norm": "post_attention_layernorm",
    "ffn_norm": "pre_feedforward_layernorm",
    "post_ffw_norm": "post_feedforward_layernorm",
}
_ARCH_LAYER_NAMES = {
    "gemma2": _LAYER_NAMES | _GEMMA_NAMES,
    "gemma3": _LAYER_NAMES | _GEMMA_NAMES,
    "phi3": _LAYER_NAMES | {"attn_qkv": "self_attn.qkv_proj", "ffn_up": "mlp.gate_up_proj"},
}
# llama.cpp's Gemma: every 2nd (Gemma 2) or 6th (Gemma 3) layer global, the others sliding, and
# a fixed RoPE base of the sliding layers (Gemma 3); the number of layers of the 27B models,
# which scale attention by hidden / heads instead of the head dim.
_GEMMA_GLOBAL_EVERY = {"gemma2": 2, "gemma3": 6}
_GEMMA_LOCAL_ROPE_BASE = 10000.0
_GEMMA_27B_LAYERS = {"gemma2": 46, "gemma3": 62}
# Tensors read into config.json's rope parameters, not weights.
_ROPE_TENSORS = {"rope_freqs.weight", "rope_factors_long.weight", "rope_factors_short.weight"}
# Stacked expert tensors [experts, rows, cols] -> each expert's matrix.
_EXPERT_NAMES = {"ffn_gate_exps": "gate_proj", "ffn_up_exps": "up_proj", "ffn_down_exps": "down_proj"}
_SHARD_BYTES = 64 << 20  # written shard by shard: conversion holds one shard (and its bytes) at a time


def open_gguf(path: str | Path) -> Any:
    """A ``gguf.GGUFReader`` over ``path``; a corrupt or truncated file raises ``ModelLoadError``."""
    import gguf

    try:
        reader = gguf.GGUFReader(str(path))
    except (ValueError, IndexError, OSError, TypeError, OverflowError) as e:
        raise ModelLoadError(f"{path}: not a readable GGUF file ({e})") from e
    arch = _field(reader, "general.architecture", path)
    if arch not in GGUF_MODEL_TYPES:
        raise ModelLoadError(
            f"{path}: unsupported GGUF architecture {arch!r} (supported: {', '.join(GGUF_MODEL_TYPES)})"
        )
    for t in reader.tensors:
        if t.tensor_type.name not in QUANT_TYPES:
            raise ModelLoadError(
                f"{path}: tensor {t.name} has unsupported quantization type {t.tensor_type.name} "
                f"(supported: {', '.join(QUANT_TYPES)})"
            )
    return reader


_MISSING = object()


def _field(reader: Any, key: str, where: str | Path, default: Any = _MISSING) -> Any:
    field = reader.fields.get(key)
    if field is None:
        if default is _MISSING:
            raise ModelLoadError(f"{where}: GGUF metadata lacks {key!r}")
        return default
    return field.contents()


def hf_config(reader: Any, where: str | Path) -> dict[str, Any]:
    """The Hugging Face ``config.json`` that the GGUF metadata describes."""
    arch = _field(reader, "general.architecture", where)

    def meta(key: str, default: Any = _MISSING) -> Any:
        return _field(reader, f"{arch}.{key}", where, default)

    scaling = meta("rope.scaling.type", "none")
    if scaling not in ("none", "linear"):
        raise ModelLoadError(f"{where}: unsupported rope scaling {scaling!r} (supported: none, linear)")
    heads, hidden = int(meta("attention.head_count")), int(meta("embedding_length"))
    names = {t.name for t in reader.tensors}
    tokens = reader.fields.get("tokenizer.ggml.tokens")
    vocab = meta("vocab_size", None) or (len(tokens.data) if tokens is not None else None)
    if vocab is None:
        raise ModelLoadError(f"{where}: GGUF metadata has neither {arch}.vocab_size nor a token list")
    head_dim = int(meta("attention.key_length", hidden // heads))
    rope: dict[str, Any] = {"rope_type": "default", "rope_theta": float(meta("rope.freq_base", 10000.0))}
    if scaling == "linear":
        rope = {**rope, "rope_type": "linear", "factor": float(meta("rope.scaling.factor"))}
    rope_tensors = {t.name: t for t in reader.tensors if t.name in _ROPE_TENSORS}
    if "rope_freqs.weight" in rope_tensors:
        original = int(meta("rope.scaling.original_context_length", 8192))
        rope = llama3_rope(
            dequantize(rope_tensors["rope_freqs.weight"]), rope["rope_theta"], head_dim, original, where
        )
    if "rope_factors_long.weight" in rope_tensors:  # Phi-3's longrope
        rope = {
            **rope,
            "rope_type": "longrope",
            "long_factor": dequantize(rope_tensors["rope_factors_long.weight"]).tolist(),
            "short_factor": dequantize(rope_tensors["rope_factors_short.weight"]).tolist(),
            "original_max_position_embeddings": int(meta("rope.scaling.original_context_length")),
        }
        if (scale := meta("rope.scaling.attn_factor", None)) is not None:
            rope["attention_factor"] = float(scale)
    model_type = GGUF_MODEL_TYPES[arch]
    cfg = {
        "architectures": [MODEL_TYPES[model_type]],
        "model_type": model_type,
        "vocab_size": int(vocab),
        "hidden_size": hidden,
        "intermediate_size": int(meta("feed_forward_length", meta("expert_feed_forward_length", 0))),
        "num_hidden_layers": int(meta("block_count")),
        "num_attention_heads": heads,
        "num_key_value_heads": int(meta("attention.head_count_kv", heads)),
        "head_dim": head_dim,
        "max_position_embeddings": int(meta("context_length")),
        "rms_norm_eps": float(meta("attention.layer_norm_rms_epsilon")),
        "rope_theta": rope["rope_theta"],
        "rope_scaling": rope if rope["rope_type"] != "default" else None,
        "tie_word_embeddings": "output.weight" not in names,
        "torch_dtype": _native_dtype(reader),
    }
    rotary = int(meta("rope.dimension_count", head_dim))
    if rotary != head_dim:
        cfg["partial_rotary_factor"] = rotary / head_dim
    if rope["rope_type"] == "longrope":  # where Phi-3's configs (and transformers) keep it too
        cfg["original_max_position_embeddings"] = rope["original_max_position_embeddings"]
    if arch in _GEMMA_GLOBAL_EVERY:
        cfg |= _gemma_config(arch, cfg, meta)
    if arch == "qwen3moe":
        cfg |= {
            "num_experts": int(meta("expert_count")),
            "num_experts_per_tok": int(meta("expert_used_count")),
            "moe_intermediate_size": int(meta("expert_feed_forward_length")),
            # llama.cpp renormalises Qwen3-MoE's chosen experts unless the file says otherwise.
            "norm_topk_prob": bool(meta("expert_weights_norm", True)),
            "decoder_sparse_step": 1,
            "mlp_only_layers": [],
        }
    for key, hf in (("bos", "bos_token_id"), ("eos", "eos_token_id"), ("padding", "pad_token_id")):
        token_id = _field(reader, f"tokenizer.ggml.{key}_token_id", where, None)
        if token_id is not None:
            cfg[hf] = int(token_id)
    return cfg


def _gemma_config(arch: str, cfg: dict[str, Any], meta: Any) -> dict[str, Any]:
    """What Gemma's config says beyond Llama's, as llama.cpp reads or hardcodes it."""
    layers, every = cfg["num_hidden_layers"], _GEMMA_GLOBAL_EVERY[arch]
    big = layers == _GEMMA_27B_LAYERS[arch]
    out = {
        "hidden_activation": "gelu_pytorch_tanh",
        "sliding_window": int(meta("attention.sliding_window")),
        "layer_types": [
            "full_attention" if (i + 1) % every == 0 else "sliding_attention" for i in range(layers)
        ],
        "query_pre_attn_scalar": cfg["hidden_size"] // cfg["num_attention_heads"] if big else cfg["head_dim"],
    }
    if arch == "gemma2":
        out["attn_logit_softcapping"] = float(meta("attn_logit_softcapping", 50.0))
        out["final_logit_softcapping"] = float(meta("final_logit_softcapping", 30.0))
    else:
        out["rope_local_base_freq"] = _GEMMA_LOCAL_ROPE_BASE
    return out


def llama3_rope(factors: torch.Tensor, theta: float, head_dim: int, original: int, where: str | Path) -> dict:
    """The ``llama3`` rope parameters whose per-frequency divisors are ``factors`` (llama.cpp
    stores only the divisors). They are 1 for high frequencies, ``factor`` for low ones, and in
    between ``1 / ((1 - s) / factor + s)`` with ``s`` linear in the frequency, so two of those
    give ``low_freq_factor`` and ``high_freq_factor`` for the original length. The result is
    checked to reproduce every factor."""
    f = factors.double()
    factor = float(f.max())
    inv = RopeConfig(theta=theta).inv_freq(head_dim).double()
    if len(f) != len(inv):
        raise ModelLoadError(f"{where}: rope_freqs.weight has {len(f)} factors for {len(inv)} frequencies")
    params = {"factor": factor, "low_freq_factor": 1.0, "high_freq_factor": 4.0}
    medium = (f > 1 + 1e-6) & (f < factor - 1e-6)
    if factor > 1 and int(medium.sum()) >= 2:
        s = (1 / f[medium] - 1 / factor) / (1 - 1 / factor)
        # s = original / wavelen / (high - low) - low / (high - low), wavelen = 2 pi / inv.
        x = original * inv[medium] / (2 * math.pi)
        slope = float((s[-1] - s[0]) / (x[-1] - x[0]))
        span = 1 / slope
        low = -float(s[0] - slope * x[0]) * span
        params = {"factor": factor, "low_freq_factor": low, "high_freq_factor": low + span}
    rope = {
        "rope_type": "llama3",
        "rope_theta": theta,
        "original_max_position_embeddings": original,
        **params,
    }
    got = RopeConfig.from_hf({"rope_scaling": rope}).inv_freq(head_dim).double()
    if not torch.allclose(inv / got, f, rtol=1e-3):
        raise ModelLoadError(f"{where}: rope_freqs.weight matches no llama3 rope scaling")
    return rope


def _native_dtype(reader: Any) -> str:
    """The dtype ``auto`` picks: the file's own float type, bfloat16 for quantized weights."""
    kinds = {t.tensor_type.name for t in reader.tensors if len(t.shape) > 1}
    if kinds <= {"F32"}:
        return "float32"
    if kinds <= {"F32", "F16"}:
        return "float16"
    return "bfloat16"


def hf_name(name: str, arch: str) -> tuple[str, str | None]:
    """(Hugging Face parameter name, the llama.cpp layer tensor kind or None) of GGUF ``name`` in
    a file of ``arch``; a stacked expert tensor's name has ``{}`` where the expert's index goes."""
    if name in _GLOBAL_NAMES:
        return _GLOBAL_NAMES[name], None
    parts, layer_names = name.split("."), _ARCH_LAYER_NAMES.get(arch, _LAYER_NAMES)
    if len(parts) == 4 and parts[0] == "blk" and parts[2] in layer_names:
        return f"model.layers.{parts[1]}.{layer_names[parts[2]]}.{parts[3]}", parts[2]
    if len(parts) == 4 and parts[0] == "blk" and parts[2] in _EXPERT_NAMES:
        return f"model.layers.{parts[1]}.mlp.experts.{{}}.{_EXPERT_NAMES[parts[2]]}.{parts[3]}", parts[2]
    raise ModelLoadError(f"unexpected GGUF tensor {name!r}")


def unpermute_qk(w: torch.Tensor, num_heads: int) -> torch.Tensor:
    """Undo llama.cpp's Q/K row order: it interleaves each head's two rotary halves (for ggml's
    pairwise rope); Hugging Face keeps them as two contiguous halves (rotate-half)."""
    half = w.shape[0] // num_heads // 2
    return w.reshape(num_heads, half, 2, *w.shape[1:]).transpose(1, 2).reshape(w.shape)


def dequantize(tensor: Any) -> torch.Tensor:
    """One GGUF tensor as float32 in PyTorch's (row-major) shape."""
    import gguf

    arr = gguf.quants.dequantize(tensor.data, tensor.tensor_type)
    # F32 comes back as a read-only view of the memory-mapped file: copy it out.
    return torch.from_numpy(np.array(arr, dtype=np.float32, copy=not arr.flags.writeable))


def architecture(reader: Any) -> str:
    return _field(reader, "general.architecture", "GGUF")


def weight_tensors(reader: Any) -> Iterator[tuple[Any, str, str | None]]:
    """(GGUF tensor, its HF name, its llama.cpp layer kind or None; see ``hf_name``) of every
    weight: the rope tensors are config.json's rope parameters instead (``hf_config``)."""
    arch = architecture(reader)
    for tensor in reader.tensors:
        if tensor.name not in _ROPE_TENSORS:
            yield (tensor, *hf_name(tensor.name, arch))


def iter_weights(reader: Any, cfg: dict[str, Any], dtype: torch.dtype) -> Iterator[tuple[str, torch.Tensor]]:
    """(HF name, weight in ``dtype``) for every tensor, one at a time (peak: one float32 copy)."""
    arch = architecture(reader)
    permuted = cfg["model_type"] in PERMUTED_QK
    heads = {"attn_q": cfg["num_attention_heads"], "attn_k": cfg["num_key_value_heads"]}
    tensors = tqdm(list(weight_tensors(reader)), desc="Dequantizing GGUF tensors", unit="tensor", leave=False)
    for tensor, name, kind in tensors:
        w = dequantize(tensor)
        if permuted and kind in heads and name.endswith(".weight"):
            w = unpermute_qk(w, heads[kind])
        if arch in _GEMMA_GLOBAL_EVERY and tensor.name.endswith("norm.weight"):
            w = w - 1  # llama.cpp's converter stored Gemma's (1 + w)
        if kind in _EXPERT_NAMES:
            for e, expert in enumerate(w.to(dtype)):
                yield name.format(e), expert.clone()
        else:
            yield name, w.to(dtype)


def save_tokenizer(path: Path, out_dir: Path) -> None:
    """The tokenizer and chat template from the GGUF metadata, saved as Hugging Face files."""
    from transformers import AutoTokenizer

    try:
        tok = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    except (OSError, ValueError, KeyError, NotImplementedError) as e:
        raise ModelLoadError(f"{path}: cannot convert the GGUF tokenizer ({e})") from e
    tok.save_pretrained(str(out_dir))


def convert(path: str | Path, out_dir: Path, dtype: torch.dtype | None) -> None:
    """Write ``out_dir`` as a Hugging Face checkpoint of the GGUF file at ``path``, in ``dtype``
    (None: the file's own, see ``_native_dtype``)."""
    from safetensors.torch import save_file

    path = Path(path)
    reader = open_gguf(path)
    cfg = hf_config(reader, path)
    if dtype is None:
        dtype = DTYPES[cfg["torch_dtype"]]
    cfg["torch_dtype"] = str(dtype).removeprefix("torch.")
    # The weights here are dequantized; the engine may keep the file's blocks instead
    # (``--quantization gguf``, ``gguf_blocks.py``).
    cfg["quantization_config"] = {"quant_method": "gguf", "file": str(path.resolve())}
    out_dir.mkdir(parents=True, exist_ok=True)
    save_tokenizer(path, out_dir)
    weight_map: dict[str, str] = {}
    shard: dict[str, torch.Tensor] = {}

    def flush() -> None:
        file = f"model-{len(set(weight_map.values())) + 1:05d}.safetensors"
        save_file(shard, str(out_dir / file), metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(shard, file))
        shard.clear()

    shard_bytes = 0
    for name, w in iter_weights(reader, cfg, dtype):
        shard[name] = w
        shard_bytes += w.nbytes
        if shard_bytes >= _SHARD_BYTES:
            flush()
            shard_bytes = 0
    if shard:
        flush()
    index = {"metadata": {"source": path.name}, "weight_map": weight_map}
    (out_dir / "model.safetensors.index.json").write_text(json.dumps(index, indent=1))
    (out_dir / "config.json").write_text(json.dumps(cfg, indent=2))


def converted_dir(path: str | Path, dtype: torch.dtype | None) -> Path:
    """The cached Hugging Face directory for GGUF ``path`` in ``dtype`` (None: the file's own),
    converted on first use, atomically: a crash leaves no half-written directory behind. The key
    names None as "auto" rather than the dtype it stands for, because finding that out means
    parsing the whole metadata (seconds for a 50k-token vocabulary)."""
    path = Path(path).resolve()
    if not path.is_file():
        raise ModelLoadError(f"{path}: no such GGUF file")
    stat = path.stat()
    dtype_name = "auto" if dtype is None else str(dtype).removeprefix("torch.")
    key = f"{path}|{stat.st_size}|{stat.st_mtime_ns}|{dtype_name}|{CONVERTER_VERSION}"
    digest = hashlib.sha256(key.encode()).hexdigest()[:16]
    target = cache_dir() / "gguf" / f"{path.stem}-{dtype_name}-{digest}"
    if (target / "config.json").is_file():
        return target
    log.info("converting %s (dtype %s; once, cached in %s)", path.name, dtype_name, target)
    build_atomically(target, lambda out: convert(path, out, dtype))
    return target
