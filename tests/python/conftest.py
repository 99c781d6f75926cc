"""Fixtures: tiny randomly initialised Hugging Face checkpoints (Llama MHA, Llama-3 style GQA
with llama3 rope scaling, Mistral with linear rope scaling, Qwen2 with QKV bias and tied
embeddings, and one of each further family: Qwen3, Phi-3, SmolLM3, OLMo 2, Mixtral, Qwen3-MoE,
Gemma 2, Gemma 3),
saved with ``save_pretrained`` plus the demo byte-level tokenizer. No downloads."""

from __future__ import annotations

import contextlib
import os
from pathlib import Path

import pytest
import torch

# The demo model is cached per test session, never in the user's home.
os.environ.setdefault(
    "NEO_RS_CACHE_DIR", str(Path(__file__).resolve().parents[2] / "target" / "neo_rs_cache")
)
# Engines run op by op unless a test asks for the compiled decoder stack (test_compiled.py):
# compiling per engine would cost every test seconds.
os.environ.setdefault("NEO_RS_ENFORCE_EAGER", "1")

# Without CUDA, Triton kernels run only in Triton's interpreter (test_triton_decode.py), and
# triton decides at import whether its own library functions (tl.cdiv, ...) can be interpreted.
# Other imports pull triton in too (transformers' attention registry does), so it is imported
# here first, under the interpreter; the variable itself stays scoped to the Triton tests.
if not torch.cuda.is_available() and "TRITON_INTERPRET" not in os.environ:
    os.environ["TRITON_INTERPRET"] = "1"
    with contextlib.suppress(ImportError):
        import triton  # noqa: F401
    del os.environ["TRITON_INTERPRET"]

VOCAB = 300  # the tokenizer has 258 tokens; the rest decode to nothing


def _config(kind: str):  # noqa: ANN202 (a transformers config)
    from transformers import LlamaConfig, MistralConfig, Qwen2Config

    common = dict(
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        initializer_range=0.1,
        max_position_embeddings=512,
        bos_token_id=256,
        eos_token_id=257,
    )
    if kind == "llama":
        return LlamaConfig(num_attention_heads=4, num_key_value_heads=4, **common)
    if kind == "llama3":
        rope = {
            "rope_type": "llama3",
            "rope_theta": 500000.0,
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 32,
        }
        return LlamaConfig(
            num_attention_heads=4, num_key_value_heads=2, head_dim=32, rope_parameters=rope, **common
        )
    if kind == "mistral":
        rope = {"rope_type": "linear", "rope_theta": 10000.0, "factor": 2.0}
        return MistralConfig(
            num_attention_heads=4, num_key_value_heads=1, sliding_window=None, rope_parameters=rope, **common
        )
    if kind == "mistral_window":  # Mistral v0.1: every layer slides (test_sliding_window.py)
        return MistralConfig(num_attention_heads=4, num_key_value_heads=2, sliding_window=8, **common)
    if kind == "qwen2":
        return Qwen2Config(num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=True, **common)
    return _family_config(kind, common)


def _family_config(kind: str, common: dict):  # noqa: ANN202 (a transformers config)
    """The families beyond Llama's, each with shapes that exercise what is new in it."""
    import transformers as tf

    if kind == "qwen3":  # per-head q/k norms; head_dim unrelated to hidden / heads; biases
        return tf.Qwen3Config(
            num_attention_heads=4, num_key_value_heads=2, head_dim=24, attention_bias=True, **common
        )
    if (
        kind == "phi3"
    ):  # fused checkpoint matrices; longrope (long factors from position 64 on), half the dims rotate
        rope = {
            "rope_type": "longrope",
            "rope_theta": 10000.0,
            "partial_rotary_factor": 0.5,
            "original_max_position_embeddings": 64,
            "short_factor": [1.0, 1.3, 2.1, 3.0],
            "long_factor": [1.5, 2.5, 4.0, 7.0],
        }
        return tf.Phi3Config(
            original_max_position_embeddings=64,  # Phi3Config's own field wins over rope_parameters'
            num_attention_heads=4,
            num_key_value_heads=2,
            rope_parameters=rope,
            sliding_window=None,
            pad_token_id=0,
            **common,
        )
    if kind == "smollm3":  # every other layer without RoPE
        return tf.SmolLM3Config(
            num_attention_heads=4, num_key_value_heads=2, no_rope_layers=[1, 0], pad_token_id=0, **common
        )
    if kind == "olmo2":  # q/k norms over the whole projection; norms after attention and the MLP
        return tf.Olmo2Config(num_attention_heads=4, num_key_value_heads=2, pad_token_id=0, **common)
    if kind == "mixtral":  # top-2 of 4 experts
        return tf.MixtralConfig(
            num_attention_heads=4, num_key_value_heads=2, num_local_experts=4, num_experts_per_tok=2, **common
        )
    if (
        kind == "qwen3_moe"
    ):  # top-1 of 5 experts, unnormalised; layer 0 dense (mlp_only_layers), layer 1 sparse
        return tf.Qwen3MoeConfig(
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=16,
            num_experts=5,
            num_experts_per_tok=1,
            moe_intermediate_size=48,
            norm_topk_prob=False,
            mlp_only_layers=[0],
            **common,
        )
    # Gemma: a sliding window shorter than the prompts, a sliding then a global layer, scores
    # scaled by query_pre_attn_scalar, (Gemma 2) capped scores and logits, (Gemma 3) q/k norms
    # and a RoPE per layer type; weights large enough that scores reach the caps and attention
    # is peaked (with the common scale, a window or a cap moves the logits by less than 1e-4).
    gemma = dict(
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        sliding_window=8,
        layer_types=["sliding_attention", "full_attention"],
        pad_token_id=0,
        tie_word_embeddings=False,  # logits large enough to reach Gemma 2's cap
        **{**common, "initializer_range": 0.4},
    )
    if kind == "gemma2":
        return tf.Gemma2Config(
            query_pre_attn_scalar=20,
            attn_logit_softcapping=2.0,
            final_logit_softcapping=3.0,
            **gemma,
        )
    if kind == "gemma3":
        rope = {
            "full_attention": {"rope_type": "linear", "rope_theta": 1000000.0, "factor": 2.0},
            "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
        }
        return tf.Gemma3TextConfig(query_pre_attn_scalar=12, rope_parameters=rope, **gemma)
    raise ValueError(kind)


def make_checkpoint(root: Path, kind: str, shard: bool = False) -> Path:
    from neo_rs.model.demo import save_tokenizer
    from transformers import AutoModelForCausalLM

    torch.manual_seed(1234)
    model = AutoModelForCausalLM.from_config(_config(kind)).eval()
    if kind.startswith("gemma"):
        with torch.no_grad():
            for name, p in model.named_parameters():
                if "norm" in name:  # they start at 1 + 0: give their weights something to do
                    p.normal_(0.0, 0.3)
            # Embeddings scaled by sqrt(hidden) would outweigh what attention adds, and the
            # tokens would only repeat the prompt's last.
            model.get_input_embeddings().weight.mul_(0.1)
    path = root / (kind + ("-sharded" if shard else ""))
    model.save_pretrained(path, max_shard_size="60KB" if shard else "5GB")
    save_tokenizer(path)
    return path


ARCHS = ["llama", "llama3", "mistral", "qwen2"]
# The families beyond Llama's (test_model_families.py).
FAMILIES = ["qwen3", "phi3", "smollm3", "olmo2", "mixtral", "qwen3_moe", "gemma2", "gemma3"]


@pytest.fixture(scope="session")
def checkpoints(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("ckpt")
    out = {kind: make_checkpoint(root, kind) for kind in ARCHS + FAMILIES}
    out["llama-sharded"] = make_checkpoint(root, "llama", shard=True)
    return out


def hf_greedy_ids(model, prompt: list[int], n: int) -> list[int]:  # noqa: ANN001 (a transformers model)
    """transformers' greedy continuation of ``prompt``, ``n`` tokens, EOS ignored. The mask is
    explicit: without one, generate masks every pad token in the prompt (SmolLM2's pad is
    <|im_end|>, which every chat turn contains)."""
    ids = torch.tensor([prompt])
    with torch.no_grad():
        out = model.generate(
            ids, attention_mask=torch.ones_like(ids), max_new_tokens=n, do_sample=False, eos_token_id=None
        )
    return out[0, len(prompt) :].tolist()


def assert_all_blocks_free(engine) -> None:  # noqa: ANN001
    s = engine.scheduler
    s.check_invariants()
    assert not engine.has_unfinished()
    for dev in ("gpu", "cpu"):
        assert s.num_free_blocks(dev) == s.num_total_blocks(dev), dev
    if (drafter := engine.drafter) is not None:  # the draft model's pool
        d = drafter.scheduler
        assert not drafter.held and not d.has_unfinished()
        assert d.num_free_blocks("gpu") == d.num_total_blocks("gpu")
