"""The decoder of every supported family (Llama 2/3, Mistral, Qwen2/3, Qwen3-MoE, Mixtral, Phi-3/4,
SmolLM3, OLMo 2, Gemma 2/3) in one readable file, gpt-fast style: the families differ in a few
switches of ``ModelConfig`` (q/k norms, norm placement and form, RoPE per layer, partial rotary,
the MLP's activation, sparse MLPs, scaled embeddings, capped logits).

Each decoder layer runs as NEO's three stages so the pipeline can interleave sub-batches:
``pre_attention`` (norm, QKV, q/k norms, RoPE, KV write), attention (``neo_rs.attention``) and
``post_attention`` (O-proj, residual, MLP). Numerics follow Hugging Face transformers (RMSNorm in
float32, rotate-half RoPE with float32 tables) so greedy outputs match token for token.

Under tensor parallelism the model is built from a rank's local config (its heads, FFN columns and
vocab rows, ``neo_rs.parallel.shards``), and the group's all-reduces join the partial sums of the
row-parallel projections and the vocab-parallel embedding; with one rank they are the identity.
"""

from __future__ import annotations

from typing import cast

import torch
import torch.nn.functional as F
from torch import nn

from neo_rs.config import ModelConfig, RopeConfig
from neo_rs.model.moe import SparseMoe
from neo_rs.parallel.group import SINGLE_PROCESS, TensorParallel


class RMSNorm(nn.Module):
    """``offset`` (Gemma): scaled by ``1 + weight`` in float32, then cast; else (Llama) cast, then
    scaled by ``weight``, as transformers rounds each."""

    def __init__(self, dim: int, eps: float, offset: bool = False) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps, self.offset = eps, offset

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        if self.offset:
            return (h * (1.0 + self.weight.float())).to(x.dtype)
        return self.weight * h.to(x.dtype)


# A forward's rotary tables, cos and sin (``Rotary.at``), ``[tables, tokens, 1, rotary_dim]``:
# one table per RoPE of the model (Gemma 3's sliding layers have their own).
Rope = tuple[torch.Tensor, torch.Tensor]


def rope_tables(cfg: ModelConfig) -> list[RopeConfig]:
    """The model's RoPEs: the global one, then the sliding layers' where it differs."""
    return [cfg.rope] if cfg.local_rope is None else [cfg.rope, cfg.local_rope]


class Rotary(nn.Module):
    """cos/sin tables for every position up to the model's length, gathered per token."""

    cos: torch.Tensor
    sin: torch.Tensor

    def __init__(self, cfg: ModelConfig, max_positions: int) -> None:
        super().__init__()
        self.ropes, self.head_dim, self.max_positions = rope_tables(cfg), cfg.head_dim, max_positions
        shape = (len(self.ropes), max_positions, cfg.rope.rotary_dim(cfg.head_dim))
        self.register_buffer("cos", torch.empty(shape), persistent=False)
        self.register_buffer("sin", torch.empty(shape), persistent=False)

    def fill_tables(self) -> None:
        """(Re)compute the tables in float32 on the buffers' device (once they are allocated)."""
        cos, sin = [], []
        for rope in self.ropes:
            with torch.device("cpu"):
                freqs = rope.angles(self.head_dim, self.max_positions)
            emb = torch.cat([freqs, freqs], dim=-1)
            cos.append(emb.cos() * rope.attention_factor)
            sin.append(emb.sin() * rope.attention_factor)
        self.cos = torch.stack(cos).to(self.cos.device)
        self.sin = torch.stack(sin).to(self.sin.device)

    def at(self, positions: torch.Tensor, dtype: torch.dtype) -> Rope:
        """cos and sin at each token's position, ``[tables, tokens, 1, rotary_dim]`` in ``dtype``:
        gathered once per forward for every layer (gathered in each layer, they cost ~5% of a
        CPU decode step)."""
        cos, sin = self.cos[:, positions].to(dtype), self.sin[:, positions].to(dtype)
        return cos[:, :, None, :], sin[:, :, None, :]


def rotate(x: torch.Tensor, rope: Rope, table: int = 0) -> torch.Tensor:
    """Rotate ``x`` ``[tokens, heads, head_dim]`` by its tokens' ``Rotary.at`` tables (table
    ``table``): the leading ``rotary_dim`` dimensions of each head (all of them but under a
    partial rotary factor)."""
    return _rotate(x, rope[0][table], rope[1][table])


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    dim = cos.shape[-1]
    if dim < x.shape[-1]:
        return torch.cat([_rotate(x[..., :dim], cos, sin), x[..., dim:]], dim=-1)
    half = dim // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return x * cos + rotated * sin


class DenseMlp(nn.Module):
    """SwiGLU (or GeGLU, ``act="gelu_pytorch_tanh"``): gate and up fused into one
    column-parallel matrix, down row-parallel."""

    def __init__(self, hidden: int, intermediate: int, tp: TensorParallel, act: str = "silu") -> None:
        super().__init__()
        self.tp, self.gelu = tp, act == "gelu_pytorch_tanh"
        self.gate_up_proj = nn.Linear(hidden, 2 * intermediate, bias=False)
        self.down_proj = nn.Linear(intermediate, hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up_proj(x).chunk(2, dim=-1)
        gate = F.gelu(gate, approximate="tanh") if self.gelu else F.silu(gate)
        return self.tp.all_reduce(self.down_proj(gate * up))


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, index: int, tp: TensorParallel = SINGLE_PROCESS) -> None:
        super().__init__()
        self.tp = tp
        self.num_heads, self.num_kv_heads, self.head_dim = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        self.uses_rope = cfg.rope_layers is None or cfg.rope_layers[index]
        kind = cfg.attention_kinds()[index]
        self.rope_table = 1 if cfg.local_rope is not None and kind.window is not None else 0
        q_size, kv_size = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
        hidden, eps, gemma = cfg.hidden_size, cfg.rms_norm_eps, cfg.gemma

        def norm(dim: int) -> RMSNorm:
            return RMSNorm(dim, eps, offset=gemma)

        # OLMo 2 normalises after attention and the MLP (post_attention_layernorm and
        # post_feedforward_layernorm), Gemma before and after both (input_, post_attention_,
        # pre_feedforward_ and post_feedforward_layernorm), the others before them (input_ and
        # post_attention_layernorm).
        self.input_layernorm: RMSNorm | None = None if cfg.post_norms else norm(hidden)
        self.qkv_proj = nn.Linear(hidden, q_size + 2 * kv_size, bias=cfg.qkv_bias)
        # q/k norms: per head (Qwen3), or over the whole projection (OLMo 2).
        self.norm_whole_projection = cfg.qk_norm == "projection"
        self.q_norm: RMSNorm | None = None
        self.k_norm: RMSNorm | None = None
        if cfg.qk_norm is not None:
            per_head = cfg.qk_norm == "head"
            self.q_norm = norm(cfg.head_dim if per_head else q_size)
            self.k_norm = norm(cfg.head_dim if per_head else kv_size)
        self.o_proj = nn.Linear(q_size, hidden, bias=cfg.o_bias)
        self.post_attention_layernorm = norm(hidden)
        self.pre_feedforward_layernorm: RMSNorm | None = norm(hidden) if gemma else None
        self.post_feedforward_layernorm: RMSNorm | None = norm(hidden) if cfg.post_norms or gemma else None
        moe = cfg.moe
        self.mlp: nn.Module = (
            SparseMoe(hidden, moe, tp)
            if moe is not None and moe.layers[index]
            else DenseMlp(hidden, cfg.intermediate_size, tp, cfg.hidden_act)
        )

    def pre_attention(self, x: torch.Tensor, rope: Rope) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Stage 1: q ``[T, heads, d]``, k and v ``[T, kv_heads, d]`` (the caller writes k/v to
        the cache); ``rope``: the tokens' rotary tables."""
        h = x if self.input_layernorm is None else self.input_layernorm(x)
        qkv = self.qkv_proj(h)
        q_size, kv_size = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        q, k, v = qkv.split([q_size, kv_size, kv_size], dim=-1)
        q_norm, k_norm, whole = self.q_norm, self.k_norm, self.norm_whole_projection
        if q_norm is not None and k_norm is not None and whole:
            q, k = q_norm(q), k_norm(k)
        q = q.reshape(-1, self.num_heads, self.head_dim)
        k = k.reshape(-1, self.num_kv_heads, self.head_dim)
        if q_norm is not None and k_norm is not None and not whole:
            q, k = q_norm(q), k_norm(k)
        if self.uses_rope:
            q, k = rotate(q, rope, self.rope_table), rotate(k, rope, self.rope_table)
        return q, k, v.view(-1, self.num_kv_heads, self.head_dim)

    def post_attention(self, attn: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
        """Stage 3: O-proj and residual, then the MLP and residual."""
        o = self.tp.all_reduce(self.o_proj(attn.reshape(attn.shape[0], -1)))
        if self.pre_feedforward_layernorm is not None and self.post_feedforward_layernorm is not None:
            h = residual + self.post_attention_layernorm(o)
            return h + self.post_feedforward_layernorm(self.mlp(self.pre_feedforward_layernorm(h)))
        if self.post_feedforward_layernorm is not None:
            h = residual + self.post_attention_layernorm(o)
            return h + self.post_feedforward_layernorm(self.mlp(h))
        h = residual + o
        return h + self.mlp(self.post_attention_layernorm(h))


class CausalLM(nn.Module):
    def __init__(
        self, cfg: ModelConfig, max_positions: int, tp: TensorParallel = SINGLE_PROCESS, vocab_size: int = 0
    ) -> None:
        """``cfg``: this rank's shapes; ``vocab_size``: the whole vocabulary (default: ``cfg``'s)."""
        super().__init__()
        self.config, self.tp = cfg, tp
        self.vocab_size = vocab_size or cfg.vocab_size
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(cfg, i, tp) for i in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, offset=cfg.gemma)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        self.rotary = Rotary(cfg, max_positions)
        self._decoder_layers: list[DecoderLayer] | None = None

    @property
    def decoder_layers(self) -> list[DecoderLayer]:
        """The layers as a typed list (built once: the forward loops index it per layer)."""
        if self._decoder_layers is None:
            self._decoder_layers = cast(list[DecoderLayer], list(self.layers))
        return self._decoder_layers

    def embed(self, ids: torch.Tensor) -> torch.Tensor:
        """The tokens' embeddings (vocab-parallel under tensor parallelism; Gemma's scaled by
        sqrt(hidden), rounded to the model's dtype as transformers rounds it)."""
        if self.tp.size == 1:
            x = self.embed_tokens(ids)
        else:
            # This rank's vocab rows; ids outside them contribute zeros to the sum over ranks.
            local = ids - self.tp.rank * self.config.vocab_size
            outside = (local < 0) | (local >= self.config.vocab_size)
            x = self.embed_tokens(local.masked_fill(outside, 0))
            x = self.tp.all_reduce(x.masked_fill_(outside[:, None], 0))
        if self.config.gemma:
            x = x * torch.tensor(self.config.hidden_size**0.5, dtype=x.dtype)
        return x

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Logits ``[rows, vocab]`` of the final hidden states of the sampled rows (on rank 0
        under tensor parallelism; other ranks get their vocab shard), in the model's dtype, or
        float32 soft-capped where the model says (Gemma 2). ``sample`` widens them exactly where
        a row reads more than their maximum: a float32 copy of 64 rows cost 0.9 ms of a 41 ms
        step of SmolLM2 on the CPU."""
        logits = self.lm_head(self.norm(hidden))
        if (cap := self.config.final_softcap) is not None:
            logits = cap * torch.tanh(logits.float() / cap)
        return self.tp.gather_vocab(logits, self.vocab_size)
