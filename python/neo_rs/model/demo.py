"""The built-in demo model: a tiny Llama with deterministic RANDOM weights and a byte-level
tokenizer, written as a real Hugging Face checkpoint into a cache directory on first use
(offline). It exists so the server and examples run with no download; its text is gibberish."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import torch
from safetensors.torch import save_file

from neo_rs.environment import build_atomically, cache_dir

log = logging.getLogger(__name__)

VERSION = 3
BOS, EOS = "<s>", "</s>"
# Hermes-style tools: offered in a system block, earlier calls rendered as <tool_call> tags.
# (Transformers renders with trim_blocks, so the newline after a message's calls is an expression.)
CHAT_TEMPLATE = (
    "{{ bos_token }}{% if tools %}<|system|>\n<tools>{{ tools | tojson }}</tools>\n"
    'Call a tool with <tool_call>{"name": ..., "arguments": ...}</tool_call>\n{% endif %}'
    "{% for m in messages %}<|{{ m['role'] }}|>\n{{ m['content'] }}"
    "{% for c in m.get('tool_calls') or [] %}<tool_call>"
    "{{ {'name': c['function']['name'], 'arguments': c['function']['arguments']} | tojson }}"
    "</tool_call>{% endfor %}{{ '\\n' }}{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)
CONFIG = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "vocab_size": 258,  # 256 bytes + <s> + </s>
    "hidden_size": 256,
    "intermediate_size": 688,
    "num_hidden_layers": 4,
    "num_attention_heads": 8,
    "num_key_value_heads": 2,
    "max_position_embeddings": 4096,  # room for the 4,000-token stream of benches/stream_cost.py
    "rms_norm_eps": 1e-5,
    "rope_theta": 10000.0,
    "tie_word_embeddings": False,
    "bos_token_id": 256,
    "eos_token_id": 257,
    "torch_dtype": "float32",
}


def save_tokenizer(model_dir: Path) -> None:
    """Write the byte-level tokenizer (256 byte tokens, <s> = 256, </s> = 257, a chat template)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    byte_chars = bytes_to_unicode()
    tok = Tokenizer(models.BPE(vocab={byte_chars[b]: b for b in range(256)}, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([BOS, EOS])
    tok.post_processor = processors.TemplateProcessing(single=f"{BOS} $A", special_tokens=[(BOS, 256)])
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token=BOS, eos_token=EOS, chat_template=CHAT_TEMPLATE
    )
    fast.save_pretrained(str(model_dir))


def _weights(cfg: dict) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    h, f, d = cfg["hidden_size"], cfg["intermediate_size"], cfg["hidden_size"] // cfg["num_attention_heads"]
    kv = cfg["num_key_value_heads"] * d

    def rand(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=g) * 0.02

    w = {"model.embed_tokens.weight": rand(cfg["vocab_size"], h)}
    for i in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{i}."
        w[p + "self_attn.q_proj.weight"] = rand(h, h)
        w[p + "self_attn.k_proj.weight"] = rand(kv, h)
        w[p + "self_attn.v_proj.weight"] = rand(kv, h)
        w[p + "self_attn.o_proj.weight"] = rand(h, h)
        w[p + "mlp.gate_proj.weight"] = rand(f, h)
        w[p + "mlp.up_proj.weight"] = rand(f, h)
        w[p + "mlp.down_proj.weight"] = rand(h, f)
        w[p + "input_layernorm.weight"] = torch.ones(h)
        w[p + "post_attention_layernorm.weight"] = torch.ones(h)
    w["model.norm.weight"] = torch.ones(h)
    w["lm_head.weight"] = rand(cfg["vocab_size"], h)
    return w


def demo_model_dir() -> Path:
    """The demo checkpoint's directory, created (atomically) on first use."""
    target = cache_dir() / f"demo-llama-v{VERSION}"
    if (target / "model.safetensors").is_file():
        return target

    def build(out: Path) -> None:
        (out / "config.json").write_text(json.dumps(CONFIG, indent=2))
        (out / "generation_config.json").write_text(json.dumps({"bos_token_id": 256, "eos_token_id": 257}))
        save_tokenizer(out)
        save_file(_weights(CONFIG), str(out / "model.safetensors"), metadata={"format": "pt"})

    build_atomically(target, build)
    log.info("created the demo model in %s", target)
    return target
