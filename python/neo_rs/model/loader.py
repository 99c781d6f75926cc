"""Load a local Hugging Face checkpoint (single or sharded safetensors) into
``LlamaForCausalLM``: a small name map from HF's parameter names onto ours (q/k/v and gate/up
are fused into one matrix each)."""

from __future__ import annotations

import json
import logging
import re
from pathlib import Path

import torch
from safetensors import safe_open
from tqdm import tqdm

from neo_rs.config import ModelConfig
from neo_rs.errors import ModelLoadError
from neo_rs.model.llama import LlamaForCausalLM

log = logging.getLogger(__name__)

_LAYER = re.compile(r"^model\.layers\.(\d+)\.(.+)$")
# HF layer parameter -> (our parameter, which part of the fused matrix).
_FUSED = {
    "self_attn.q_proj": ("qkv_proj", 0),
    "self_attn.k_proj": ("qkv_proj", 1),
    "self_attn.v_proj": ("qkv_proj", 2),
    "mlp.gate_proj": ("gate_up_proj", 0),
    "mlp.up_proj": ("gate_up_proj", 1),
}
_RENAMED = {"self_attn.o_proj": "o_proj", "mlp.down_proj": "down_proj"}


def shard_files(model_dir: Path) -> list[Path]:
    index = model_dir / "model.safetensors.index.json"
    if index.is_file():
        weight_map = json.loads(index.read_text()).get("weight_map", {})
        files = sorted({model_dir / f for f in weight_map.values()})
        missing = [f.name for f in files if not f.is_file()]
        if missing:
            raise ModelLoadError(
                f"{model_dir}: shards listed in {index.name} are missing: {', '.join(missing)}"
            )
        return files
    single = model_dir / "model.safetensors"
    if single.is_file():
        return [single]
    raise ModelLoadError(
        f"{model_dir}: no model.safetensors or model.safetensors.index.json "
        "(only safetensors weights are supported)"
    )


def _target(cfg: ModelConfig, name: str) -> tuple[str, slice | None] | None:
    """Our parameter and row slice for HF parameter ``name``; None for names we do not use."""
    if name in ("model.embed_tokens.weight", "model.norm.weight", "lm_head.weight"):
        return name.removeprefix("model."), None
    m = _LAYER.match(name)
    if not m:
        return None
    layer, rest = m.groups()
    module, _, kind = rest.rpartition(".")
    if module in ("input_layernorm", "post_attention_layernorm"):
        return f"layers.{layer}.{rest}", None
    if module in _RENAMED:
        return f"layers.{layer}.{_RENAMED[module]}.{kind}", None
    if module in _FUSED:
        ours, part = _FUSED[module]
        if ours == "qkv_proj":
            q, kv = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
            bounds = [0, q, q + kv, q + 2 * kv]
        else:
            bounds = [0, cfg.intermediate_size, 2 * cfg.intermediate_size]
        return f"layers.{layer}.{ours}.{kind}", slice(bounds[part], bounds[part + 1])
    return None


def load_model(
    model_dir: str | Path, cfg: ModelConfig, dtype: torch.dtype, device: torch.device, max_positions: int
) -> LlamaForCausalLM:
    model_dir = Path(model_dir)
    files = shard_files(model_dir)
    with torch.device("meta"):
        model = LlamaForCausalLM(cfg, max_positions).to(dtype)  # cast on meta: no float32 copy first
    model.to_empty(device=device)
    model.rotary.fill_tables()
    params = dict(model.named_parameters())
    # Rows written per parameter, to name anything the checkpoint did not provide.
    filled = {name: 0 for name in params}
    for path in tqdm(files, desc="Loading safetensors shards", unit="shard", disable=len(files) < 2):
        with safe_open(str(path), framework="pt", device="cpu") as f:
            for name in f.keys():  # noqa: SIM118 (safe_open is not a mapping)
                target = _target(cfg, name)
                if target is None:
                    continue
                ours, rows = target
                if ours not in params:
                    raise ModelLoadError(f"{path.name}: unexpected parameter {name!r} for {cfg.architecture}")
                dst = params[ours].data if rows is None else params[ours].data[rows]
                src = f.get_tensor(name)
                if src.shape != dst.shape:
                    raise ModelLoadError(
                        f"{path.name}: {name} has shape {tuple(src.shape)}, "
                        f"the config implies {tuple(dst.shape)}"
                    )
                dst.copy_(src)
                filled[ours] += dst.shape[0]
    if filled["lm_head.weight"] == 0 and cfg.tie_word_embeddings:
        model.lm_head.weight = model.embed_tokens.weight
        filled["lm_head.weight"] = model.lm_head.weight.shape[0]
    missing = [n for n, p in params.items() if filled[n] != p.shape[0]]
    if missing:
        raise ModelLoadError(
            f"{model_dir}: the checkpoint lacks {', '.join(missing[:5])}" + (" …" if len(missing) > 5 else "")
        )
    log.info("loaded %s (%d layers, %s) from %s", cfg.architecture, cfg.num_layers, dtype, model_dir)
    return model.eval()
