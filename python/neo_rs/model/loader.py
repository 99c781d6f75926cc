"""Load a local Hugging Face checkpoint (single or sharded safetensors) into ``CausalLM``: a
small name map from each family's parameter names onto ours (q/k/v and gate/up are fused into one
matrix each, as Phi-3's checkpoints already are; an MoE layer's experts are stacked)."""

from __future__ import annotations

import json
import logging
import re
from collections.abc import Collection
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import safe_open
from tqdm import tqdm

from neo_rs.config import ModelConfig, MoeConfig
from neo_rs.errors import ModelLoadError
from neo_rs.model.decoder import CausalLM
from neo_rs.model.quant import decoder_linears
from neo_rs.parallel.group import SINGLE_PROCESS, TensorParallel
from neo_rs.parallel.shards import TpShard

log = logging.getLogger(__name__)

_LAYER = re.compile(r"^model\.layers\.(\d+)\.(.+)$")
# HF layer module -> (our module, the fused matrix's parts it fills: one, or all of them when the
# checkpoint fuses them too). Column-parallel: each rank reads its output rows.
_COLUMN = {
    "self_attn.q_proj": ("qkv_proj", [0]),
    "self_attn.k_proj": ("qkv_proj", [1]),
    "self_attn.v_proj": ("qkv_proj", [2]),
    "self_attn.qkv_proj": ("qkv_proj", [0, 1, 2]),  # Phi-3
    "mlp.gate_proj": ("mlp.gate_up_proj", [0]),
    "mlp.up_proj": ("mlp.gate_up_proj", [1]),
    "mlp.gate_up_proj": ("mlp.gate_up_proj", [0, 1]),  # Phi-3
}
# Row-parallel: each rank reads its input columns.
_ROW = {"self_attn.o_proj": "o_proj", "mlp.down_proj": "mlp.down_proj"}
# The linears a quantization keeps (``quant.decoder_linears``): each layer's fused QKV and
# gate/up, its O and down; never the router, the experts, the embeddings or the LM head.
_QUANTIZED = re.compile(r"^layers\.\d+\.(qkv_proj|o_proj|mlp\.gate_up_proj|mlp\.down_proj)\.weight$")
_NORMS = (
    "input_layernorm",
    "post_attention_layernorm",
    "pre_feedforward_layernorm",
    "post_feedforward_layernorm",
)
# The tensor that marks a module as quantized: GPTQ's and AWQ's ``qweight``, FP8's scales.
_QUANTIZED_MARKS = (".qweight", ".weight_scale", ".weight_scale_inv")
# The tensors of a quantized checkpoint's linear, read by ``gptq_awq.py`` (GPTQ, AWQ) or
# ``fp8_checkpoint.py`` (whose e4m3 weights are named ``weight``, told by their dtype).
PACKED_TENSORS = (*_QUANTIZED_MARKS, ".qzeros", ".scales", ".g_idx", ".input_scale")
FP8_DTYPE = "F8_E4M3"
# An expert's matrices: Mixtral's w1/w3/w2, Qwen3-MoE's gate/up/down.
_EXPERT = re.compile(r"^(?:block_sparse_moe|mlp)\.experts\.(\d+)\.(w1|w3|w2|gate_proj|up_proj|down_proj)$")
_EXPERT_PART = {"w1": 0, "gate_proj": 0, "w3": 1, "up_proj": 1}


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
class Placement:
    """Where (part of) a checkpoint tensor goes: our parameter, the part of it (None: all of it;
    an expert's matrix in a stacked one is indexed by the expert first), and the rows and columns
    of the checkpoint tensor this rank reads (None: all of it); ``zero``: this rank fills its copy
    with zeros instead (a row-parallel bias, added by rank 0 alone)."""

    ours: str
    rows: tuple[int | slice, ...] | None = None
    src: tuple[slice, ...] | None = None
    zero: bool = False


def _span(r: range, scale: int = 1, offset: int = 0) -> slice:
    return slice(offset + r.start * scale, offset + r.stop * scale)


def _parts(
    cfg: ModelConfig, local: ModelConfig, shard: TpShard, fused: str
) -> list[tuple[int, int, range, int]]:
    """Each part of our fused matrix ``fused`` (qkv, gate/up of the MLP or of an expert): (its
    first row here, its rows here, the rows this rank reads of the checkpoint's part, that part's
    first row in a checkpoint that fuses the parts too)."""
    d = cfg.head_dim
    if fused == "qkv_proj":
        q, kv = local.num_heads * d, local.num_kv_heads * d
        heads, kv_heads = _span(shard.heads(cfg), d), _span(shard.kv_heads(cfg), d)
        whole_q, whole_kv = cfg.num_heads * d, cfg.num_kv_heads * d
        return [
            (0, q, range(heads.start, heads.stop), 0),
            (q, kv, range(kv_heads.start, kv_heads.stop), whole_q),
            (q + kv, kv, range(kv_heads.start, kv_heads.stop), whole_q + whole_kv),
        ]
    size, whole, cols = (
        (local.intermediate_size, cfg.intermediate_size, shard.ffn(cfg))
        if fused == "mlp.gate_up_proj"
        else (_moe(local).intermediate_size, _moe(cfg).intermediate_size, shard.moe_ffn(cfg))
    )
    return [(0, size, cols, 0), (size, size, cols, whole)]


def _moe(cfg: ModelConfig) -> MoeConfig:
    assert cfg.moe is not None, "expert weights in a dense model's config"
    return cfg.moe


def _column(
    ours: str, parts: list[tuple[int, int, range, int]], which: list[int], expert: tuple[int, ...] = ()
) -> list[Placement]:
    """Placements of a column-parallel checkpoint tensor holding parts ``which`` of ``ours`` (of
    its matrix ``expert`` when it stacks experts)."""
    fused = len(which) > 1
    return [
        Placement(ours, (*expert, slice(at, at + n)), (_span(src, 1, offset if fused else 0),))
        for at, n, src, offset in (parts[p] for p in which)
    ]


def placements(cfg: ModelConfig, local: ModelConfig, shard: TpShard, name: str) -> list[Placement]:
    """Where HF parameter ``name`` goes on rank ``shard`` (whose shapes are ``local``); empty for
    names we do not use."""
    d = cfg.head_dim
    if name in ("model.embed_tokens.weight", "lm_head.weight"):
        vocab = shard.vocab(cfg)
        return [Placement(name.removeprefix("model."), (slice(0, len(vocab)),), (_span(vocab),))]
    if name == "model.norm.weight":
        return [Placement("norm.weight")]
    m = _LAYER.match(name)
    if not m:
        return []
    layer, rest = m.groups()
    module, _, kind = rest.rpartition(".")
    prefix = f"layers.{layer}."
    if module in _NORMS:
        return [Placement(prefix + rest)]
    if module in ("self_attn.q_norm", "self_attn.k_norm"):  # per head (replicated) or whole (TP 1)
        return [Placement(prefix + rest.removeprefix("self_attn."))]
    if module in _COLUMN:
        ours, which = _COLUMN[module]
        return _column(f"{prefix}{ours}.{kind}", _parts(cfg, local, shard, ours), which)
    if module in _ROW:
        if kind == "bias":  # summed over ranks by the all-reduce: rank 0 adds it
            return [Placement(f"{prefix}{_ROW[module]}.bias", zero=shard.rank != 0)]
        cols = _span(shard.heads(cfg), d) if module == "self_attn.o_proj" else _span(shard.ffn(cfg))
        return [Placement(f"{prefix}{_ROW[module]}.{kind}", None, (slice(None), cols))]
    if module in ("block_sparse_moe.gate", "mlp.gate"):  # the router, replicated
        return [Placement(f"{prefix}mlp.router.{kind}")]
    e = _EXPERT.match(module)
    if e:
        expert, matrix = int(e.group(1)), e.group(2)
        if matrix in _EXPERT_PART:
            parts = _parts(cfg, local, shard, "expert")
            return _column(f"{prefix}mlp.w_gate_up", parts, [_EXPERT_PART[matrix]], (expert,))
        return [Placement(f"{prefix}mlp.w_down", (expert,), (slice(None), _span(shard.moe_ffn(cfg))))]
    return []


def empty_model(
    cfg: ModelConfig,
    dtype: torch.dtype,
    device: torch.device,
    max_positions: int,
    tp: TensorParallel = SINGLE_PROCESS,
    unallocated: Collection[str] = (),
    leave_linears: bool = False,
) -> CausalLM:
    """The model (rank ``tp.rank``'s shard) with its weights allocated but not filled, those
    named in ``unallocated`` (and, with ``leave_linears``, every decoder linear's) left on the
    meta device."""
    with torch.device("meta"):  # built on meta: nothing allocated until its dtype is known
        model = CausalLM(tp.shard.local_config(cfg), max_positions, tp, cfg.vocab_size)
    if leave_linears:
        unallocated = {*unallocated, *(f"{name}.weight" for name, *_ in decoder_linears(model))}
    _allocate(model, dtype, device, unallocated)
    model.rotary.fill_tables()
    return model


def _allocate(
    model: torch.nn.Module, dtype: torch.dtype, device: torch.device, unallocated: Collection[str]
) -> None:
    """Each parameter (but ``unallocated``'s) and buffer of a meta model as uninitialised memory on
    ``device``, the floating ones in ``dtype``. Not ``Module.to(dtype).to_empty(device)``: under a
    fake-tensor mode (the memory plan) those convert the meta tensors, and torch then refuses to
    swap them in."""

    def empty(t: torch.Tensor) -> torch.Tensor:
        return torch.empty(t.shape, dtype=dtype if t.is_floating_point() else t.dtype, device=device)

    for prefix, module in model.named_modules():
        for name, p in module._parameters.items():
            if p is not None and (f"{prefix}.{name}" if prefix else name) not in unallocated:
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
    built_later: Collection[str] = (),
    quantize_later: bool = False,
) -> CausalLM:
    """The model of checkpoint ``model_dir``, or under tensor parallelism rank ``tp.rank``'s shard
    of it: each tensor is read through a safetensors slice, so no rank holds the whole model.
    A quantized checkpoint's linears, the weights named in ``built_later`` (a GGUF's kept blocks)
    and with ``quantize_later`` every decoder linear's are left on the meta device, unread, for
    ``gptq_awq.py``, ``fp8_checkpoint.py``, ``gguf_blocks.py`` or ``quantize_at_load`` to build."""
    model_dir = Path(model_dir)
    files = shard_files(model_dir)
    local = tp.shard.local_config(cfg)
    packed = cfg.quantized_checkpoint is not None
    # Linears kept quantized are never allocated as floats: a 4-bit model needs no room for its
    # 16-bit twin, even for a moment.
    quantized = _quantized_weights(files, cfg, local, tp.shard) if packed else set()
    model = empty_model(cfg, dtype, device, max_positions, tp, {*quantized, *built_later}, quantize_later)
    params = dict(model.named_parameters())
    left = {name for name, p in params.items() if p.is_meta}
    # Elements written per parameter, to name anything the checkpoint did not provide.
    filled = {name: 0 for name in params}
    for path in tqdm(files, desc="Loading safetensors shards", unit="shard", disable=len(files) < 2):
        with safe_open(str(path), framework="pt", device="cpu") as f:
            for name in f.keys():  # noqa: SIM118 (safe_open is not a mapping)
                if packed and (name.endswith(PACKED_TENSORS) or f.get_slice(name).get_dtype() == FP8_DTYPE):
                    continue
                for place in placements(cfg, local, tp.shard, name):
                    if place.ours in left:
                        continue
                    if place.ours not in params:
                        raise ModelLoadError(
                            f"{path.name}: unexpected parameter {name!r} for {cfg.architecture}"
                        )
                    param = params[place.ours].data
                    dst = param if place.rows is None else param[place.rows]
                    filled[place.ours] += dst.numel()
                    if place.zero:
                        dst.zero_()
                        continue
                    whole = f.get_slice(name)
                    want = _source_shape(whole.get_shape(), place.src)
                    if want != tuple(dst.shape):
                        raise ModelLoadError(
                            f"{path.name}: {name} has shape {tuple(whole.get_shape())}, "
                            f"the config implies {tuple(dst.shape)} for this rank"
                        )
                    dst.copy_(whole[place.src] if place.src is not None else whole[:])
    for vocab_param in ("embed_tokens.weight", "lm_head.weight"):
        # The last rank's padding rows (never looked up; their logits are cut off).
        padding = params[vocab_param].data[filled[vocab_param] // cfg.hidden_size :]
        if filled[vocab_param] and len(padding):
            padding.zero_()
            filled[vocab_param] += padding.numel()
    if filled["lm_head.weight"] == 0 and cfg.tie_word_embeddings:
        model.lm_head.weight = model.embed_tokens.weight
        filled["lm_head.weight"] = model.lm_head.weight.numel()
    missing = [n for n, p in params.items() if filled[n] != p.numel() and n not in left]
    if missing:
        raise ModelLoadError(
            f"{model_dir}: the checkpoint lacks {', '.join(missing[:5])}" + (" …" if len(missing) > 5 else "")
        )
    where = f" (rank {tp.rank} of {tp.size})" if tp.size > 1 else ""
    log.info("loaded %s (%d layers, %s) from %s%s", cfg.architecture, cfg.num_layers, dtype, model_dir, where)
    return model.eval()


def quantizable(weight: str) -> bool:
    """Whether our parameter ``weight`` (``layers.N.qkv_proj.weight``...) is a linear that a
    quantization keeps."""
    return _QUANTIZED.match(weight) is not None


def _quantized_weights(files: list[Path], cfg: ModelConfig, local: ModelConfig, shard: TpShard) -> set[str]:
    """Our weights (``layers.N.qkv_proj.weight``...) that a quantized checkpoint's tensors fill:
    those of each module with a ``qweight`` (GPTQ, AWQ) or a ``weight_scale(_inv)`` (FP8)."""
    ours = set()
    for path in files:
        with safe_open(str(path), framework="pt", device="cpu") as f:
            for name in f.keys():  # noqa: SIM118 (safe_open is not a mapping)
                mark = next((m for m in _QUANTIZED_MARKS if name.endswith(m)), None)
                if mark is not None:
                    module = name.removesuffix(mark)
                    ours |= {
                        p.ours
                        for p in placements(cfg, local, shard, module + ".weight")
                        if quantizable(p.ours)
                    }
    return ours


def _source_shape(shape: list[int], src: tuple[slice, ...] | None) -> tuple[int, ...]:
    """The shape of ``tensor[src]`` for a tensor of ``shape``."""
    if src is None:
        return tuple(shape)
    picked = [len(range(*s.indices(n))) for s, n in zip(src, shape, strict=False)]
    return (*picked, *shape[len(src) :])
