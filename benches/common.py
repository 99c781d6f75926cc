"""Shared pieces of the Python benchmarks: the ~20M-parameter random Llama and seeded prompts."""

from __future__ import annotations

from pathlib import Path

import torch


def make_model(root: Path) -> Path:
    """A random Llama (vocab 32000, hidden 256, 4 layers, 8 heads / 2 KV heads, FFN 688)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(
        vocab_size=32000,
        hidden_size=256,
        intermediate_size=688,
        num_hidden_layers=4,
        num_attention_heads=8,
        num_key_value_heads=2,
        max_position_embeddings=2048,
    )
    torch.manual_seed(0)
    model = LlamaForCausalLM(cfg)
    path = root / "llama-20m"
    model.save_pretrained(path)
    print(f"model: {sum(p.numel() for p in model.parameters()) / 1e6:.1f}M parameters")
    return path


def prompts(n: int, lo: int = 32, hi: int = 256, seed: int = 1) -> list[list[int]]:
    """``n`` prompts of random token ids, lengths uniform in [lo, hi]."""
    g = torch.Generator().manual_seed(seed)
    lens = torch.randint(lo, hi + 1, (n,), generator=g).tolist()
    return [torch.randint(3, 32000, (k,), generator=g).tolist() for k in lens]
