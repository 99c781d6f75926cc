"""Shared pieces of the Python benchmarks: the ~20M-parameter random Llama, random Llamas of a
given shape, seeded prompts, and the CPU line every speed figure is printed beside."""

from __future__ import annotations

import json
import platform
from pathlib import Path

import torch
from safetensors.torch import save_file

# The shape of the benchmarks' small random models (~20M parameters).
SMALL = dict(
    vocab_size=32000,
    hidden_size=256,
    intermediate_size=688,
    num_hidden_layers=4,
    num_attention_heads=8,
    num_key_value_heads=2,
)


def make_model(root: Path) -> Path:
    """A random Llama (vocab 32000, hidden 256, 4 layers, 8 heads / 2 KV heads, FFN 688)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(**SMALL, max_position_embeddings=2048)
    torch.manual_seed(0)
    model = LlamaForCausalLM(cfg)
    path = root / "llama-20m"
    model.save_pretrained(path)
    save_word_tokenizer(path, cfg.vocab_size)
    print(f"model: {sum(p.numel() for p in model.parameters()) / 1e6:.1f}M parameters")
    return path


def make_moe_pair(root: Path, hidden: int = 512, layers: int = 4) -> tuple[Path, Path]:
    """A random Qwen3-MoE shaped like Qwen3-30B-A3B at a smaller width (experts of hidden / 2
    columns, 32 of them, 4 per token: its active to total MLP ratio at a quarter of its expert
    count), and the same model made dense with the active parameter count (one MLP of 4 experts'
    columns)."""
    from transformers import Qwen3Config, Qwen3ForCausalLM, Qwen3MoeConfig, Qwen3MoeForCausalLM

    common = dict(
        vocab_size=32000,
        hidden_size=hidden,
        num_hidden_layers=layers,
        num_attention_heads=8,
        num_key_value_heads=2,
        head_dim=64,
        max_position_embeddings=2048,
    )
    expert, top_k = hidden // 2, 4
    out = []
    for name, model in (
        (
            "qwen3-moe",
            Qwen3MoeForCausalLM(
                Qwen3MoeConfig(
                    intermediate_size=top_k * expert,
                    moe_intermediate_size=expert,
                    num_experts=32,
                    num_experts_per_tok=top_k,
                    norm_topk_prob=True,
                    **common,
                )
            ),
        ),
        ("qwen3-dense-active", Qwen3ForCausalLM(Qwen3Config(intermediate_size=top_k * expert, **common))),
    ):
        torch.manual_seed(0)
        path = root / name
        model.save_pretrained(path)
        save_word_tokenizer(path, 32000)
        print(f"{name}: {sum(p.numel() for p in model.parameters()) / 1e6:.1f}M parameters")
        out.append(path)
    return out[0], out[1]


def save_word_tokenizer(path: Path, vocab_size: int) -> None:
    """A word-level tokenizer over the words ``w0 … w{vocab_size-1}``: every token decodes to
    visible text, so streamed chunks carry one word each."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {f"w{i}": i for i in range(vocab_size)}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="w0"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="w0", bos_token="w1", eos_token="w2")
    fast.save_pretrained(str(path))


def prompts(n: int, lo: int = 32, hi: int = 256, seed: int = 1) -> list[list[int]]:
    """``n`` prompts of random token ids, lengths uniform in [lo, hi]."""
    g = torch.Generator().manual_seed(seed)
    lens = torch.randint(lo, hi + 1, (n,), generator=g).tolist()
    return [torch.randint(3, 32000, (k,), generator=g).tolist() for k in lens]


def warm_up_and_queue(engine, batch: list[list[int]], max_tokens: int) -> None:  # noqa: ANN001 (an LLMEngine)
    """Run one short request to completion (first-call costs out of the figures), then queue the
    batch: greedy, ``max_tokens`` each, EOS ignored."""
    from neo_rs import SamplingParams

    engine.add_request(batch[0][:16], SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))
    while engine.has_unfinished():
        engine.step()
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    for p in batch:
        engine.add_request(p, params)


def cpu_line() -> str:
    """The CPU's model name, family and model numbers (a VM's name may be only "AMD EPYC": family
    25 is Zen 3/4, 26 Zen 5, whose 512-bit datapaths double bf16 GEMMs), and the flags that move
    our figures (``/proc/cpuinfo``)."""
    model, flags, ids = platform.processor() or "unknown CPU", set(), {}
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            key, _, value = line.partition(":")
            if key.strip() == "model name":
                model = value.strip()
            elif key.strip() in ("cpu family", "model"):
                ids.setdefault(key.strip(), value.strip())
            elif key.strip() == "flags":
                flags = set(value.split())
    except OSError:
        pass
    family = f" family {ids['cpu family']} model {ids['model']}" if len(ids) == 2 else ""
    noted = " ".join(f for f in ("avx512_bf16", "avx512_vnni", "amx_bf16", "amx_int8") if f in flags)
    return f"{model}{family} ({platform.machine()}), flags: {noted or 'none of note'}"


def random_llama(root: Path, shape: tuple[int, ...]) -> Path:
    """A Llama checkpoint of ``shape`` with random bf16 weights (tied embeddings, as Llama 3.2)."""
    hidden, inter, heads, kv, d, layers, vocab = shape
    g = torch.Generator().manual_seed(0)

    def w(*s: int) -> torch.Tensor:
        return (torch.randn(*s, generator=g) * 0.02).to(torch.bfloat16)

    tensors = {
        "model.embed_tokens.weight": w(vocab, hidden),
        "model.norm.weight": torch.ones(hidden).bfloat16(),
    }
    for i in range(layers):
        p = f"model.layers.{i}."
        tensors |= {
            p + "input_layernorm.weight": torch.ones(hidden).bfloat16(),
            p + "post_attention_layernorm.weight": torch.ones(hidden).bfloat16(),
            p + "self_attn.q_proj.weight": w(heads * d, hidden),
            p + "self_attn.k_proj.weight": w(kv * d, hidden),
            p + "self_attn.v_proj.weight": w(kv * d, hidden),
            p + "self_attn.o_proj.weight": w(hidden, heads * d),
            p + "mlp.gate_proj.weight": w(inter, hidden),
            p + "mlp.up_proj.weight": w(inter, hidden),
            p + "mlp.down_proj.weight": w(hidden, inter),
        }
    save_file(tensors, root / "model.safetensors", metadata={"format": "pt"})
    cfg = {
        "architectures": ["LlamaForCausalLM"],
        "hidden_size": hidden,
        "intermediate_size": inter,
        "num_attention_heads": heads,
        "num_key_value_heads": kv,
        "head_dim": d,
        "num_hidden_layers": layers,
        "vocab_size": vocab,
        "rms_norm_eps": 1e-5,
        "rope_theta": 500000.0,
        "max_position_embeddings": 4096,
        "tie_word_embeddings": True,
        "torch_dtype": "bfloat16",
    }
    (root / "config.json").write_text(json.dumps(cfg))
    return root
