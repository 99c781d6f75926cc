"""GGUF loading on tiny files written with the ``gguf`` package (Llama, Qwen2, Qwen3, Qwen3-MoE,
Phi-3, Gemma 2, Gemma 3):
every supported quantization type dequantizes to what transformers' own GGUF loading produces, the
Q/K permutation round-trips, the converted checkpoint generates like transformers, Llama 3.1's
rope factors become its rope scaling, and bad files raise ``ModelLoadError``."""

from __future__ import annotations

import itertools
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
from conftest import hf_greedy_ids
from neo_rs import LLM, SamplingParams
from neo_rs.errors import ModelLoadError
from neo_rs.model.gguf import QUANT_TYPES, converted_dir, hf_config, iter_weights, open_gguf, unpermute_qk

Q = gguf.GGMLQuantizationType
HIDDEN, FFN, HEADS, KV_HEADS, LAYERS = 256, 256, 4, 2, 2  # K-quants need rows of 256
HEAD_DIM = HIDDEN // HEADS
# transformers' GGUF reader takes Qwen3-MoE's expert width from its default (768), not the file.
EXPERTS, EXPERTS_USED, EXPERT_FFN = 4, 2, 768
ARCHS = ["llama", "qwen2", "qwen3", "qwen3moe", "phi3", "gemma2", "gemma3"]
# Gemma's window, shorter than the longer test prompts; its head dim is 256 (its models' own),
# where llama.cpp's attention scale and transformers' default query_pre_attn_scalar agree.
GEMMA_WINDOW = 16
# Byte offsets of each quantized block's fp16 scale fields, which random bytes must not make NaN.
_F16_FIELDS = {
    "Q4_0": [0], "Q4_1": [0, 2], "Q5_0": [0], "Q5_1": [0, 2], "Q8_0": [0],
    "Q2_K": [80, 82], "Q3_K": [108], "Q4_K": [0, 2], "Q5_K": [0, 2], "Q6_K": [208],
}  # fmt: skip
# The fp16 scales' size: K-quants' super-block scales multiply 6-bit sub-scales (up to 63).
_SCALE_SIZE = {"Q2_K": 0.003, "Q4_K": 0.0003, "Q5_K": 0.0003}


def _bytes_to_unicode() -> list[str]:
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    table = bytes_to_unicode()
    return [table[b] for b in range(256)]


def llama_cpp_permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """llama.cpp's converter (convert_hf_to_gguf.py, LlamaModel.permute), restated for the test."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _tensor(
    rng: np.random.Generator, shape: tuple[int, int], qtype: str, realistic: bool = False, pow2: bool = False
) -> tuple[np.ndarray, Q | None]:
    """A tensor of ``shape`` stored as ``qtype``: floats, or random blocks with sane scales
    (``realistic``: normal floats quantized by ``gguf``, for the types it quantizes; ``pow2``:
    scales, and Q6_K's sub-scales, that are powers of two, so that Q8_0's, Q5_*'s and Q6_K's
    weights are exact in bfloat16)."""
    if qtype in ("F32", "F16"):
        return (rng.standard_normal(shape) * 0.05).astype(np.float32 if qtype == "F32" else np.float16), None
    if qtype == "BF16" or (realistic and qtype in ("Q4_0", "Q4_1", "Q8_0")):
        return gguf.quants.quantize((rng.standard_normal(shape) * 0.05).astype(np.float32), Q[qtype]), Q[
            qtype
        ]
    block, size = gguf.GGML_QUANT_SIZES[Q[qtype]]
    blocks = rng.integers(0, 256, (shape[0] * shape[1] // block, size), dtype=np.uint8)
    for off in _F16_FIELDS[qtype]:
        scale = (rng.uniform(0.2, 1.0, len(blocks)) * _SCALE_SIZE.get(qtype, 0.01)).astype(np.float16)
        if pow2:
            scale = np.exp2(np.round(np.log2(scale.astype(np.float32)))).astype(np.float16)
        blocks[:, off : off + 2] = scale.view(np.uint8).reshape(-1, 2)
    if pow2 and qtype == "Q6_K":
        sub = rng.choice(np.array([1, 2, 4, 8, -1, -2, -4, -8], dtype=np.int8), (len(blocks), 16))
        blocks[:, 192:208] = sub.view(np.uint8)
    return blocks.reshape(shape[0], -1), Q[qtype]


def write_gguf(
    path: Path,
    arch: str = "llama",
    types: list[str] | None = None,
    seed: int = 0,
    rope_freqs: np.ndarray | None = None,
    rope_factors: tuple[np.ndarray, np.ndarray] | None = None,
    realistic: bool = False,
    pow2: bool = False,
) -> Path:
    """A tiny GGUF of ``arch`` (Qwen3's with q/k norms, Qwen3-MoE's with stacked experts, Phi-3's
    with fused projections, Gemma's with four norms per layer and a window) with a byte-level
    tokenizer; 2-D tensors cycle through ``types`` (``realistic``, ``pow2``: see ``_tensor``)."""
    rng = np.random.default_rng(seed)
    types = types or QUANT_TYPES
    w = gguf.GGUFWriter(str(path), arch)
    # Phi-3's fused projections leave fewer matrices per layer: a third layer gives every type one.
    layers = LAYERS + 1 if arch == "phi3" else LAYERS
    w.add_block_count(layers)
    w.add_context_length(256)
    w.add_embedding_length(HIDDEN)
    w.add_feed_forward_length(FFN)
    w.add_head_count(HEADS)
    w.add_head_count_kv(KV_HEADS)
    # Qwen3's head dim is its own (128), not hidden / heads: transformers' reader assumes 128.
    head_dim = 128 if arch.startswith("qwen3") else 256 if arch.startswith("gemma") else HEAD_DIM
    gemma = arch.startswith("gemma")
    w.add_key_length(head_dim)
    w.add_rope_freq_base(10000.0)
    if arch == "qwen3moe":
        w.add_expert_count(EXPERTS)
        w.add_expert_used_count(EXPERTS_USED)
        w.add_expert_feed_forward_length(EXPERT_FFN)
    if gemma:
        w.add_sliding_window(GEMMA_WINDOW)
    if arch == "gemma2":
        w.add_attn_logit_softcapping(50.0)
        w.add_final_logit_softcapping(30.0)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("default")
    w.add_token_list([*_bytes_to_unicode(), "<s>", "</s>"])
    w.add_token_types([1] * 256 + [3, 3])
    w.add_token_scores([0.0] * 258)  # no merges: transformers derives them (none) from the scores
    w.add_bos_token_id(256)
    w.add_eos_token_id(257)
    if arch == "phi3":  # else transformers takes Phi3Config's pad id (32000), outside this vocabulary
        w.add_pad_token_id(257)
    w.add_chat_template("{% for m in messages %}{{ m['content'] }}\n{% endfor %}")
    vocab, q, kv = 258, HEADS * head_dim, KV_HEADS * head_dim
    shapes = {"attn_q": (q, HIDDEN), "attn_k": (kv, HIDDEN), "attn_v": (kv, HIDDEN)}
    shapes |= {"attn_output": (HIDDEN, q), "ffn_gate": (FFN, HIDDEN), "ffn_up": (FFN, HIDDEN)}
    shapes |= {"ffn_down": (HIDDEN, FFN)}
    if arch == "qwen3moe":  # the dense MLP's place: a router and stacked experts
        del shapes["ffn_gate"], shapes["ffn_up"], shapes["ffn_down"]
        shapes |= {"ffn_gate_inp": (EXPERTS, HIDDEN)}
    if arch == "phi3":  # q, k and v in one matrix; gate and up in one
        del shapes["attn_q"], shapes["attn_k"], shapes["attn_v"], shapes["ffn_gate"]
        shapes |= {"attn_qkv": (q + 2 * kv, HIDDEN), "ffn_up": (2 * FFN, HIDDEN)}
    norms = ["attn_norm", "ffn_norm"] + (["post_attention_norm", "post_ffw_norm"] if gemma else [])
    kinds = itertools.cycle(types)

    def add(name: str, shape: tuple[int, ...]) -> None:
        if len(shape) == 3:  # stacked experts: one type for the whole tensor
            parts = [_tensor(rng, shape[1:], qtype, realistic, pow2) for qtype in [next(kinds)] * shape[0]]
            w.add_tensor(name, np.stack([d for d, _ in parts]), raw_dtype=parts[0][1])
            return
        data, raw_dtype = _tensor(rng, shape, next(kinds), realistic, pow2)
        w.add_tensor(name, data, raw_dtype=raw_dtype)

    for name in ("token_embd.weight",) if gemma else ("token_embd.weight", "output.weight"):  # Gemma ties
        add(name, (vocab, HIDDEN))
    w.add_tensor("output_norm.weight", rng.uniform(0.5, 1.5, HIDDEN).astype(np.float32))
    for i in range(layers):
        for kind in norms:
            w.add_tensor(f"blk.{i}.{kind}.weight", rng.uniform(0.5, 1.5, HIDDEN).astype(np.float32))
        for kind, shape in shapes.items():
            add(f"blk.{i}.{kind}.weight", shape)
            if arch == "qwen2" and kind in ("attn_q", "attn_k", "attn_v"):
                bias = (rng.standard_normal(shape[0]) * 0.05).astype(np.float32)
                w.add_tensor(f"blk.{i}.{kind}.bias", bias)
        if arch.startswith("qwen3") or arch == "gemma3":
            for kind in ("attn_q_norm", "attn_k_norm"):
                w.add_tensor(f"blk.{i}.{kind}.weight", rng.uniform(0.5, 1.5, head_dim).astype(np.float32))
        if arch == "qwen3moe":
            for kind in ("ffn_gate_exps", "ffn_up_exps"):
                add(f"blk.{i}.{kind}.weight", (EXPERTS, EXPERT_FFN, HIDDEN))
            add(f"blk.{i}.ffn_down_exps.weight", (EXPERTS, HIDDEN, EXPERT_FFN))
    if rope_freqs is not None:
        w.add_tensor("rope_freqs.weight", rope_freqs.astype(np.float32))
    if rope_factors is not None:  # Phi-3's longrope, as llama.cpp writes it (original length 64)
        w.add_rope_scaling_orig_ctx_len(64)
        w.add_tensor("rope_factors_long.weight", rope_factors[0].astype(np.float32))
        w.add_tensor("rope_factors_short.weight", rope_factors[1].astype(np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("gguf")
    return {arch: write_gguf(root / f"tiny-{arch}.gguf", arch) for arch in ARCHS}


def _transformers(path: Path):  # noqa: ANN202 (a transformers model)
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=torch.float32)


# transformers holds Qwen3-MoE's experts stacked; its generation is compared below instead.
@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3", "phi3", "gemma2", "gemma3"])
def test_every_quant_type_dequantizes_like_transformers(tiny, arch: str) -> None:
    reader = open_gguf(tiny[arch])
    cfg = hf_config(reader, tiny[arch])
    kinds = {t.tensor_type.name for t in reader.tensors}
    assert set(QUANT_TYPES) <= kinds, set(QUANT_TYPES) - kinds
    ours = dict(iter_weights(reader, cfg, torch.float32))
    want = _transformers(tiny[arch]).state_dict()
    if cfg["tie_word_embeddings"]:  # Gemma: transformers lists the tied head too
        assert want.pop("lm_head.weight").data_ptr() == want["model.embed_tokens.weight"].data_ptr()
    assert set(ours) == set(want)
    for name, w in ours.items():
        assert torch.isfinite(w).all(), name
        torch.testing.assert_close(w, want[name], rtol=0, atol=0, msg=name)


def test_qk_permutation_round_trips() -> None:
    w = np.arange(12 * 8 * 5, dtype=np.float32).reshape(12 * 8, 5)
    for n_head in (1, 3, 12):
        permuted = llama_cpp_permute(w, n_head)
        assert not np.array_equal(permuted, w)
        assert np.array_equal(unpermute_qk(torch.from_numpy(permuted), n_head).numpy(), w)


@pytest.mark.parametrize("arch", ARCHS)
def test_gguf_model_generates_like_transformers(tiny, arch: str) -> None:
    prompts = [[256, 72, 105], list(range(10, 40)), [5, 9, 200, 31] * 3]
    hf = _transformers(tiny[arch]).eval()
    want = [hf_greedy_ids(hf, p, 8) for p in prompts]
    llm = LLM(str(tiny[arch]), dtype="float32", num_gpu_blocks=32)
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=8, ignore_eos=True), use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == want
    tok = llm.get_tokenizer()
    assert tok.eos_token == "</s>" and tok.chat_template.startswith("{% for m in messages %}")
    assert llm.engine.eos_ids == {257}


def test_conversion_is_cached_per_dtype(tiny) -> None:
    first = converted_dir(tiny["llama"], torch.bfloat16)
    stamp = (first / "config.json").stat().st_mtime_ns
    assert converted_dir(tiny["llama"], torch.bfloat16) == first
    assert (first / "config.json").stat().st_mtime_ns == stamp
    assert converted_dir(tiny["llama"], torch.float16) != first


def test_auto_dtype_is_bfloat16_for_quantized_and_the_float_type_otherwise(tmp_path: Path) -> None:
    quantized = LLM(str(write_gguf(tmp_path / "q.gguf", types=["Q8_0"])), num_gpu_blocks=8)
    assert quantized.engine.dtype == torch.bfloat16
    half = LLM(str(write_gguf(tmp_path / "h.gguf", types=["F16"])), num_gpu_blocks=8)
    assert half.engine.dtype == torch.float16


def test_truncated_or_corrupt_file_raises_model_load_error(tiny, tmp_path: Path) -> None:
    data = tiny["llama"].read_bytes()
    for name, blob in [("truncated", data[: len(data) // 3]), ("header", data[:100]), ("junk", b"x" * 4096)]:
        bad = tmp_path / f"{name}.gguf"
        bad.write_bytes(blob)
        with pytest.raises(ModelLoadError, match="GGUF"):
            LLM(str(bad))


def _llama3_factors(theta: float, factor: float, low: float, high: float, original: int) -> np.ndarray:
    """llama.cpp's rope_freqs for Llama 3.1 scaling (convert_hf_to_gguf.py), restated."""
    out = []
    for freq in 1 / theta ** (np.arange(0, HEAD_DIM, 2) / HEAD_DIM):
        wavelen = 2 * np.pi / freq
        if wavelen < original / high:
            out.append(1.0)
        elif wavelen > original / low:
            out.append(factor)
        else:
            smooth = (original / wavelen - low) / (high - low)
            out.append(1 / ((1 - smooth) / factor + smooth))
    return np.array(out)


def test_llama31_rope_freqs_become_llama3_rope_scaling(tmp_path: Path) -> None:
    import json

    from transformers import LlamaConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    factors = _llama3_factors(10000.0, 8.0, 1.0, 4.0, 64)
    assert ((factors > 1) & (factors < 8)).sum() >= 2  # some frequencies are smoothed
    path = write_gguf(tmp_path / "llama31.gguf", types=["F32"], rope_freqs=factors)
    converted = converted_dir(path, torch.float32)
    cfg = json.loads((converted / "config.json").read_text())
    assert cfg["rope_scaling"]["rope_type"] == "llama3"
    # transformers' own llama3 rope, from the parameters we wrote, divides by the file's factors.
    inv, _ = ROPE_INIT_FUNCTIONS["llama3"](LlamaConfig(**cfg), "cpu")
    base = 1 / 10000.0 ** (torch.arange(0, HEAD_DIM, 2, dtype=torch.float64) / HEAD_DIM)
    torch.testing.assert_close(inv.double(), base / torch.from_numpy(factors), rtol=1e-5, atol=0)
    prompts = [[256, 72, 105], list(range(10, 80))]
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(converted, dtype=torch.float32).eval()
    llm = LLM(str(path), dtype="float32", num_gpu_blocks=32)
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=8, ignore_eos=True), use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == [hf_greedy_ids(hf, p, 8) for p in prompts]


def test_phi3_rope_factors_become_its_longrope(tmp_path: Path) -> None:
    import json

    from transformers import AutoModelForCausalLM

    rng = np.random.default_rng(3)
    long, short = rng.uniform(1, 4, HEAD_DIM // 2), rng.uniform(1, 1.5, HEAD_DIM // 2)
    path = write_gguf(tmp_path / "phi3.gguf", "phi3", types=["F32"], rope_factors=(long, short))
    converted = converted_dir(path, torch.float32)
    rope = json.loads((converted / "config.json").read_text())["rope_scaling"]
    assert rope["rope_type"] == "longrope" and rope["original_max_position_embeddings"] == 64
    np.testing.assert_allclose(rope["long_factor"], long, rtol=1e-6)
    np.testing.assert_allclose(rope["short_factor"], short, rtol=1e-6)
    # Within the original length, where transformers and we rotate alike (past it, transformers
    # re-rotates the whole sequence with the long factors: README, Models).
    prompts = [list(range(10, 40)), [5, 9, 200, 31] * 6]
    hf = AutoModelForCausalLM.from_pretrained(converted, dtype=torch.float32).eval()
    with LLM(str(path), dtype="float32", num_gpu_blocks=32) as llm:
        params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
        outs = llm.generate(prompts, params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == [hf_greedy_ids(hf, p, 8) for p in prompts]


def test_gemma_config_follows_what_llama_cpp_hardcodes() -> None:
    # The 27B models scale attention by hidden / heads (their HF configs' query_pre_attn_scalar:
    # 144 and 168), the others by the head dim; Gemma 3's every 6th layer is global.
    from neo_rs.model.gguf import _gemma_config

    meta = {"attention.sliding_window": 4096}.get
    shapes = {  # (layers, hidden, heads, head_dim) -> scalar
        ("gemma2", 46, 4608, 32, 128): 144,
        ("gemma2", 42, 3584, 16, 256): 256,
        ("gemma3", 62, 5376, 32, 128): 168,
        ("gemma3", 34, 2560, 8, 256): 256,
    }
    for (arch, layers, hidden, heads, head_dim), scalar in shapes.items():
        cfg = {
            "num_hidden_layers": layers,
            "hidden_size": hidden,
            "num_attention_heads": heads,
            "head_dim": head_dim,
        }
        got = _gemma_config(arch, cfg, meta)
        assert got["query_pre_attn_scalar"] == scalar, (arch, layers)
        full = [i for i, t in enumerate(got["layer_types"]) if t == "full_attention"]
        assert full == list(range(1 if arch == "gemma2" else 5, layers, 2 if arch == "gemma2" else 6))


def test_rope_freqs_no_llama3_scaling_explains_are_refused(tmp_path: Path) -> None:
    factors = np.random.default_rng(0).uniform(1, 8, HEAD_DIM // 2)
    path = write_gguf(tmp_path / "odd.gguf", types=["F32"], rope_freqs=factors)
    with pytest.raises(ModelLoadError, match="matches no llama3 rope scaling"):
        hf_config(open_gguf(path), path)


def test_unsupported_architecture_is_named(tmp_path: Path) -> None:
    with pytest.raises(ModelLoadError, match="unsupported GGUF architecture 'gpt2'"):
        open_gguf(write_gguf(tmp_path / "gpt2.gguf", arch="gpt2", types=["F32"]))


def test_unsupported_quant_type_is_named(tmp_path: Path) -> None:
    path = tmp_path / "iq.gguf"
    w = gguf.GGUFWriter(str(path), "llama")
    block, size = gguf.GGML_QUANT_SIZES[Q.IQ4_NL]
    w.add_tensor("token_embd.weight", np.zeros((8, 256 // block * size), np.uint8), raw_dtype=Q.IQ4_NL)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    with pytest.raises(ModelLoadError, match="unsupported quantization type IQ4_NL"):
        open_gguf(path)
