"""The Llama family (Llama 2/3, Mistral, Qwen2) in one readable file, gpt-fast style.

Each decoder layer runs as NEO's three stages so the pipeline can interleave sub-batches:
``pre_attention`` (norm, QKV, RoPE, KV write), attention (``neo_rs.attention``) and
``post_attention`` (O-proj, residual, FFN). Numerics follow Hugging Face transformers (RMSNorm in
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
        self.register_buffer("cos", torch.empty(max_positions, cfg.head_dim), persistent=False)
        self.register_buffer("sin", torch.empty(max_positions, cfg.head_dim), persistent=False)

    def fill_tables(self) -> None:
        """(Re)compute the tables in float32 on the buffers' device (once they are allocated)."""
        with torch.device("cpu"):
            inv_freq = self.rope.inv_freq(self.head_dim)
            freqs = torch.outer(torch.arange(self.max_positions, dtype=torch.float32), inv_freq)
        emb = torch.cat([freqs, freqs], dim=-1)
        self.cos = emb.cos().to(self.cos.device)
        self.sin = emb.sin().to(self.sin.device)

    def at(self, positions: torch.Tensor, dtype: torch.dtype) -> Rope:
        """cos and sin at each token's position, ``[tokens, 1, head_dim]`` in ``dtype``: gathered
        once per forward for every layer (gathered in each layer, they cost ~5% of a CPU decode step)."""
        return self.cos[positions].to(dtype)[:, None, :], self.sin[positions].to(dtype)[:, None, :]


def rotate(x: torch.Tensor, rope: Rope) -> torch.Tensor:
    """Rotate ``x`` ``[tokens, heads, head_dim]`` by its tokens' ``Rotary.at`` tables."""
    cos, sin = rope
    half = x.shape[-1] // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return x * cos + rotated * sin


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, tp: TensorParallel = SINGLE_PROCESS) -> None:
        super().__init__()
        self.tp = tp
        self.num_heads, self.num_kv_heads, self.head_dim = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        q_size, kv_size = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.qkv_proj = nn.Linear(cfg.hidden_size, q_size + 2 * kv_size, bias=cfg.qkv_bias)
        self.o_proj = nn.Linear(q_size, cfg.hidden_size, bias=False)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.gate_up_proj = nn.Linear(cfg.hidden_size, 2 * cfg.intermediate_size, bias=False)
        self.down_proj = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=False)

    def pre_attention(self, x: torch.Tensor, rope: Rope) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Stage 1: q ``[T, heads, d]``, k and v ``[T, kv_heads, d]`` (the caller writes k/v to
        the cache); ``rope``: the tokens' rotary tables."""
        qkv = self.qkv_proj(self.input_layernorm(x))
        q_size, kv_size = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        q, k, v = qkv.split([q_size, kv_size, kv_size], dim=-1)
        q = rotate(q.view(-1, self.num_heads, self.head_dim), rope)
        k = rotate(k.view(-1, self.num_kv_heads, self.head_dim), rope)
        return q, k, v.view(-1, self.num_kv_heads, self.head_dim)

    def post_attention(self, attn: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
        """Stage 3: O-proj and residual, then the SwiGLU FFN and residual."""
        h = residual + self.tp.all_reduce(self.o_proj(attn.reshape(attn.shape[0], -1)))
        gate, up = self.gate_up_proj(self.post_attention_layernorm(h)).chunk(2, dim=-1)
        return h + self.tp.all_reduce(self.down_proj(F.silu(gate) * up))


class LlamaForCausalLM(nn.Module):
    def __init__(
        self, cfg: ModelConfig, max_positions: int, tp: TensorParallel = SINGLE_PROCESS, vocab_size: int = 0
    ) -> None:
        """``cfg``: this rank's shapes; ``vocab_size``: the whole vocabulary (default: ``cfg``'s)."""
        super().__init__()
        self.config, self.tp = cfg, tp
        self.vocab_size = vocab_size or cfg.vocab_size
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(cfg, tp) for _ in range(cfg.num_layers))
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
