"""The decoder of every supported family (Llama 2/3, Mistral, Qwen2/3, Qwen3-MoE, Mixtral, Phi-3/4,
SmolLM3, OLMo 2) in one readable file, gpt-fast style: the families differ in a few switches of
``ModelConfig`` (q/k norms, norm placement, RoPE per layer, partial rotary, sparse MLPs).

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

from neo_rs.config import ModelConfig
from neo_rs.model.moe import SparseMoe
from neo_rs.parallel.group import SINGLE_PROCESS, TensorParallel


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * h.to(x.dtype)


# A forward's rotary tables, cos and sin (``Rotary.at``).
Rope = tuple[torch.Tensor, torch.Tensor]


class Rotary(nn.Module):
    """cos/sin tables for every position up to the model's length, gathered per token."""

    cos: torch.Tensor
    sin: torch.Tensor

    def __init__(self, cfg: ModelConfig, max_positions: int) -> None:
        super().__init__()
        self.rope, self.head_dim, self.max_positions = cfg.rope, cfg.head_dim, max_positions
        dim = cfg.rope.rotary_dim(cfg.head_dim)
        self.register_buffer("cos", torch.empty(max_positions, dim), persistent=False)
        self.register_buffer("sin", torch.empty(max_positions, dim), persistent=False)

    def fill_tables(self) -> None:
        """(Re)compute the tables in float32 on the buffers' device (once they are allocated)."""
        with torch.device("cpu"):
            freqs = self.rope.angles(self.head_dim, self.max_positions)
        emb = torch.cat([freqs, freqs], dim=-1)
        scale = self.rope.attention_factor
        self.cos = (emb.cos() * scale).to(self.cos.device)
        self.sin = (emb.sin() * scale).to(self.sin.device)

    def at(self, positions: torch.Tensor, dtype: torch.dtype) -> Rope:
        """cos and sin at each token's position, ``[tokens, 1, rotary_dim]`` in ``dtype``: gathered
        once per forward for every layer (gathered in each layer, they cost ~5% of a CPU decode step)."""
        return self.cos[positions].to(dtype)[:, None, :], self.sin[positions].to(dtype)[:, None, :]


def rotate(x: torch.Tensor, rope: Rope) -> torch.Tensor:
    """Rotate ``x`` ``[tokens, heads, head_dim]`` by its tokens' ``Rotary.at`` tables: the leading
    ``rotary_dim`` dimensions of each head (all of them but under a partial rotary factor)."""
    cos, sin = rope
    dim = cos.shape[-1]
    if dim < x.shape[-1]:
        return torch.cat([rotate(x[..., :dim], rope), x[..., dim:]], dim=-1)
    half = dim // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return x * cos + rotated * sin


class DenseMlp(nn.Module):
    """SwiGLU: gate and up fused into one column-parallel matrix, down row-parallel."""

    def __init__(self, hidden: int, intermediate: int, tp: TensorParallel) -> None:
        super().__init__()
        self.tp = tp
        self.gate_up_proj = nn.Linear(hidden, 2 * intermediate, bias=False)
        self.down_proj = nn.Linear(intermediate, hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up_proj(x).chunk(2, dim=-1)
        return self.tp.all_reduce(self.down_proj(F.silu(gate) * up))


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, index: int, tp: TensorParallel = SINGLE_PROCESS) -> None:
        super().__init__()
        self.tp = tp
        self.num_heads, self.num_kv_heads, self.head_dim = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        self.uses_rope = cfg.rope_layers is None or cfg.rope_layers[index]
        q_size, kv_size = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
        hidden, eps = cfg.hidden_size, cfg.rms_norm_eps
        # OLMo 2 normalises after attention and the MLP (post_attention_layernorm and
        # post_feedforward_layernorm), the others before them (input_ and post_attention_layernorm).
        self.input_layernorm: RMSNorm | None = None if cfg.post_norms else RMSNorm(hidden, eps)
        self.qkv_proj = nn.Linear(hidden, q_size + 2 * kv_size, bias=cfg.qkv_bias)
        # q/k norms: per head (Qwen3), or over the whole projection (OLMo 2).
        self.norm_whole_projection = cfg.qk_norm == "projection"
        self.q_norm: RMSNorm | None = None
        self.k_norm: RMSNorm | None = None
        if cfg.qk_norm is not None:
            per_head = cfg.qk_norm == "head"
            self.q_norm = RMSNorm(cfg.head_dim if per_head else q_size, eps)
            self.k_norm = RMSNorm(cfg.head_dim if per_head else kv_size, eps)
        self.o_proj = nn.Linear(q_size, hidden, bias=cfg.o_bias)
        self.post_attention_layernorm = RMSNorm(hidden, eps)
        self.post_feedforward_layernorm: RMSNorm | None = RMSNorm(hidden, eps) if cfg.post_norms else None
        moe = cfg.moe
        self.mlp: nn.Module = (
            SparseMoe(hidden, moe, tp)
            if moe is not None and moe.layers[index]
            else DenseMlp(hidden, cfg.intermediate_size, tp)
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
            q, k = rotate(q, rope), rotate(k, rope)
        return q, k, v.view(-1, self.num_kv_heads, self.head_dim)

    def post_attention(self, attn: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
        """Stage 3: O-proj and residual, then the MLP and residual."""
        o = self.tp.all_reduce(self.o_proj(attn.reshape(attn.shape[0], -1)))
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
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
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
        """The tokens' embeddings (vocab-parallel under tensor parallelism)."""
        if self.tp.size == 1:
            return self.embed_tokens(ids)
        # This rank's vocab rows; ids outside them contribute zeros to the sum over ranks.
        local = ids - self.tp.rank * self.config.vocab_size
        outside = (local < 0) | (local >= self.config.vocab_size)
        x = self.embed_tokens(local.masked_fill(outside, 0))
        return self.tp.all_reduce(x.masked_fill_(outside[:, None], 0))

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Float32 logits ``[rows, vocab]`` of the final hidden states of the sampled rows (on
        rank 0 under tensor parallelism; other ranks get their vocab shard)."""
        return self.tp.gather_vocab(self.lm_head(self.norm(hidden)).float(), self.vocab_size)
