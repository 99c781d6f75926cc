"""Load a local Hugging Face checkpoint (single or sharded safetensors) into
``LlamaForCausalLM``: a small name map from HF's parameter names onto ours (q/k/v and gate/up
are fused into one matrix each)."""

from __future__ import annotations

import json
import logging
import re
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import safe_open
from tqdm import tqdm

from neo_rs.config import ModelConfig
from neo_rs.errors import ModelLoadError
from neo_rs.model.llama import LlamaForCausalLM
from neo_rs.parallel.group import SINGLE_PROCESS, TensorParallel
from neo_rs.parallel.shards import TpShard

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


@dataclass(frozen=True)
class _Placement:
    """Where (part of) a checkpoint tensor goes: our parameter, its rows (None: all of it), and
    the rows and columns of the checkpoint tensor this rank reads (None: all of it)."""

    ours: str
    rows: slice | None = None
    src: tuple[slice, ...] | None = None


def _span(r: range, scale: int = 1) -> slice:
    return slice(r.start * scale, r.stop * scale)


def _target(cfg: ModelConfig, local: ModelConfig, shard: TpShard, name: str) -> _Placement | None:
    """Where HF parameter ``name`` goes on rank ``shard`` (whose shapes are ``local``); None for
    names we do not use."""
    d = cfg.head_dim
    if name in ("model.embed_tokens.weight", "lm_head.weight"):
        vocab = shard.vocab(cfg)
        return _Placement(name.removeprefix("model."), slice(0, len(vocab)), (_span(vocab),))
    if name == "model.norm.weight":
        return _Placement("norm.weight")
    m = _LAYER.match(name)
    if not m:
        return None
    layer, rest = m.groups()
    module, _, kind = rest.rpartition(".")
    if module in ("input_layernorm", "post_attention_layernorm"):
        return _Placement(f"layers.{layer}.{rest}")
    if module in _RENAMED:  # row-parallel: this rank's input columns
        cols = _span(shard.heads(cfg), d) if module == "self_attn.o_proj" else _span(shard.ffn(cfg))
        return _Placement(f"layers.{layer}.{_RENAMED[module]}.{kind}", None, (slice(None), cols))
    if module in _FUSED:  # column-parallel: this rank's output rows, into its part of the fused matrix
        ours, part = _FUSED[module]
        if ours == "qkv_proj":
            q, kv = local.num_heads * d, local.num_kv_heads * d
            bounds = [0, q, q + kv, q + 2 * kv]
            src = _span(shard.heads(cfg) if part == 0 else shard.kv_heads(cfg), d)
        else:
            bounds = [0, local.intermediate_size, 2 * local.intermediate_size]
            src = _span(shard.ffn(cfg))
        return _Placement(f"layers.{layer}.{ours}.{kind}", slice(bounds[part], bounds[part + 1]), (src,))
    return None


def empty_model(
    cfg: ModelConfig,
    dtype: torch.dtype,
    device: torch.device,
    max_positions: int,
    tp: TensorParallel = SINGLE_PROCESS,
) -> LlamaForCausalLM:
    """The model (rank ``tp.rank``'s shard) with its weights allocated but not filled."""
    with torch.device("meta"):  # built on meta: nothing allocated until its dtype is known
        model = LlamaForCausalLM(tp.shard.local_config(cfg), max_positions, tp, cfg.vocab_size)
    _allocate(model, dtype, device)
    model.rotary.fill_tables()
    return model


def _allocate(model: torch.nn.Module, dtype: torch.dtype, device: torch.device) -> None:
    """Each parameter and buffer of a meta model as uninitialised memory on ``device``, the floating
    ones in ``dtype``. Not ``Module.to(dtype).to_empty(device)``: under a fake-tensor mode (the
    memory plan) those convert the meta tensors, and torch then refuses to swap them in."""

    def empty(t: torch.Tensor) -> torch.Tensor:
        return torch.empty(t.shape, dtype=dtype if t.is_floating_point() else t.dtype, device=device)

    for module in model.modules():
        for name, p in module._parameters.items():
            if p is not None:
                module._parameters[name] = torch.nn.Parameter(empty(p), requires_grad=p.requires_grad)
        for name, b in module._buffers.items():
            if b is not None:
                module._buffers[name] = empty(b)


def load_model(
    model_dir: str | Path,
    cfg: ModelConfig,
    dtype: torch.dtype,
    device: torch.device,
    max_positions: int,
    tp: TensorParallel = SINGLE_PROCESS,
) -> LlamaForCausalLM:
    """The model of checkpoint ``model_dir``, or under tensor parallelism rank ``tp.rank``'s shard
    of it: each tensor is read through a safetensors slice, so no rank holds the whole model."""
    model_dir = Path(model_dir)
    files = shard_files(model_dir)
    local = tp.shard.local_config(cfg)
    model = empty_model(cfg, dtype, device, max_positions, tp)
    params = dict(model.named_parameters())
    # Rows written per parameter, to name anything the checkpoint did not provide.
    filled = {name: 0 for name in params}
    for path in tqdm(files, desc="Loading safetensors shards", unit="shard", disable=len(files) < 2):
        with safe_open(str(path), framework="pt", device="cpu") as f:
            for name in f.keys():  # noqa: SIM118 (safe_open is not a mapping)
                place = _target(cfg, local, tp.shard, name)
                if place is None:
                    continue
                if place.ours not in params:
                    raise ModelLoadError(f"{path.name}: unexpected parameter {name!r} for {cfg.architecture}")
                param = params[place.ours].data
                dst = param if place.rows is None else param[place.rows]
                whole = f.get_slice(name)
                want = _source_shape(whole.get_shape(), place.src)
                if want != tuple(dst.shape):
                    raise ModelLoadError(
                        f"{path.name}: {name} has shape {tuple(whole.get_shape())}, "
                        f"the config implies {tuple(dst.shape)} for this rank"
                    )
                dst.copy_(whole[place.src] if place.src is not None else whole[:])
                filled[place.ours] += dst.shape[0]
    for vocab_param in ("embed_tokens.weight", "lm_head.weight"):
        # The last rank's padding rows (never looked up; their logits are cut off).
        padding = params[vocab_param].data[filled[vocab_param] :]
        if filled[vocab_param] and len(padding):
            padding.zero_()
            filled[vocab_param] += len(padding)
    if filled["lm_head.weight"] == 0 and cfg.tie_word_embeddings:
        model.lm_head.weight = model.embed_tokens.weight
        filled["lm_head.weight"] = model.lm_head.weight.shape[0]
    missing = [n for n, p in params.items() if filled[n] != p.shape[0]]
    if missing:
        raise ModelLoadError(
            f"{model_dir}: the checkpoint lacks {', '.join(missing[:5])}" + (" …" if len(missing) > 5 else "")
        )
    where = f" (rank {tp.rank} of {tp.size})" if tp.size > 1 else ""
    log.info("loaded %s (%d layers, %s) from %s%s", cfg.architecture, cfg.num_layers, dtype, model_dir, where)
    return model.eval()


def _source_shape(shape: list[int], src: tuple[slice, ...] | None) -> tuple[int, ...]:
    """The shape of ``tensor[src]`` for a tensor of ``shape``."""
    if src is None:
        return tuple(shape)
    picked = [len(range(*s.indices(n))) for s, n in zip(src, shape, strict=False)]
    return (*picked, *shape[len(src) :])
