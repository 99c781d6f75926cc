"""A GGUF's 4-bit blocks kept quantized (``--quantization gguf``, a .gguf model's default): Q4_0,
Q4_1 and Q4_K read as exactly what ``gguf`` dequantizes; each kept linear, placed as the loader
places the float weight (fused parts, llama.cpp's Q/K row order, tensor-parallel shards),
multiplies by that weight; the engine generates token for token as with the file dequantized
(``--quantization none``) in every offload mode, keeps int4's share of the bytes, leaves a linear
with any other type as floats, and refuses ``gguf`` without a GGUF."""

from __future__ import annotations

from pathlib import Path

import gguf
import pytest
import torch
from neo_rs import LLM, InvalidArgumentError, SamplingParams
from neo_rs.config import ModelConfig
from neo_rs.model.gguf import converted_dir, dequantize, open_gguf
from neo_rs.model.gguf_blocks import KEPT_TYPES, GgufBlocks, int4_blocks
from neo_rs.model.loader import load_model
from neo_rs.model.quant import Int4Linear, Int8Linear, decoder_linears
from neo_rs.parallel.group import SINGLE_PROCESS, TensorParallel
from neo_rs.parallel.shards import TpShard
from test_gguf import write_gguf
from test_quant import MODES, tokens_and_count

GREEDY = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
PROMPTS = [[256, 72, 105], list(range(10, 47)), [7], [5, 9, 200, 31] * 4]


@pytest.fixture(scope="module")
def files(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("gguf-blocks")
    kept = list(KEPT_TYPES)
    return {
        # Llama: llama.cpp permuted its Q/K rows; Qwen2: QKV biases; Phi-3: fused QKV and gate/up.
        **{
            arch: write_gguf(root / f"{arch}.gguf", arch, types=kept, seed=3)
            for arch in ("llama", "qwen2", "phi3")
        },
        # Normal weights quantized by gguf: a model whose greedy tokens vary.
        "normal": write_gguf(root / "normal.gguf", types=["Q4_0", "Q4_1"], seed=5, realistic=True),
        # Every third matrix Q6_K: a fused linear with a Q6_K part stays float.
        "mixed": write_gguf(root / "mixed.gguf", types=["Q4_0", "Q4_K", "Q6_K"], seed=4),
    }


@pytest.mark.parametrize("kind", KEPT_TYPES)
def test_blocks_are_what_gguf_dequantizes(files, kind: str) -> None:
    tensors = [
        t for t in open_gguf(files["llama"]).tensors if t.tensor_type == gguf.GGMLQuantizationType[kind]
    ]
    assert tensors
    for t in tensors:
        q, scale, zero, order = int4_blocks(t)
        assert q.dtype == torch.uint8 and int(q.max()) <= 15 and order is None
        w = ((q.float() - 8).reshape(*scale.shape, 32) * scale[..., None] + zero[..., None]).reshape(q.shape)
        assert torch.equal(w, dequantize(t)), t.name


@pytest.mark.parametrize(
    ("arch", "rank", "size"), [("llama", 0, 1), ("llama", 1, 2), ("qwen2", 0, 2), ("phi3", 1, 2)]
)
def test_each_kept_linear_multiplies_by_the_weight_the_loader_placed(
    files, arch: str, rank: int, size: int
) -> None:
    path = files[arch]
    model_dir = converted_dir(path, torch.float32)
    cfg = ModelConfig.from_dir(model_dir)
    shard = TpShard(rank, size)
    tp = SINGLE_PROCESS if size == 1 else TensorParallel(shard)
    model = load_model(model_dir, cfg, torch.float32, torch.device("cpu"), 64, tp)
    floats = {name: linear.weight.detach().clone() for name, _, _, linear in decoder_linears(model)}
    assert GgufBlocks(path, cfg, shard).keep(model) == (len(floats), 0)
    for name, weight in floats.items():
        linear = model.get_submodule(name)
        assert isinstance(linear, Int4Linear), name
        eye = torch.eye(linear.in_features)
        got = linear(eye).t() - (0 if linear.bias is None else linear.bias[:, None])
        torch.testing.assert_close(got, weight, rtol=1e-6, atol=1e-7, msg=name)


@pytest.mark.parametrize("offload", list(MODES))
def test_kept_blocks_generate_like_the_file_dequantized(files, offload: str) -> None:
    kept, n = tokens_and_count(files["normal"], Int4Linear, offload)  # inferred from the file
    dequantized, none = tokens_and_count(files["normal"], Int4Linear, offload, quantization="none")
    assert (n, none) == (8, 0)  # 2 layers of QKV, O, gate/up and down
    assert kept == dequantized
    assert len({t for seq in kept for t in seq}) > 3  # the weights make no degenerate model


def test_kept_blocks_take_int4s_share_of_the_bytes(files, monkeypatch) -> None:
    monkeypatch.setenv("NEO_RS_PACK_LINEARS", "0")  # oneDNN's packed bf16 weights are not in state_dict

    def layer_bytes(quantization: str | None) -> int:
        with LLM(str(files["llama"]), dtype="bfloat16", num_gpu_blocks=16, quantization=quantization) as llm:
            return sum(
                t.numel() * t.element_size() for t in llm.engine.runner.model.layers.state_dict().values()
            )

    # 4 bits a weight, a bf16 scale and zero per 32: 0.31x of bf16, the norms as they were.
    assert layer_bytes(None) <= 0.35 * layer_bytes("none")


def test_a_linear_with_another_type_stays_float(files) -> None:
    with LLM(str(files["mixed"]), dtype="float32", num_gpu_blocks=16) as llm:
        model = llm.engine.runner.model
        names = [
            f"layers.{i}.{m}"
            for i in range(2)
            for m in ("qkv_proj", "o_proj", "mlp.gate_up_proj", "mlp.down_proj")
        ]
        linears = {name: type(model.get_submodule(name)) for name in names}
    # Types cycle Q4_0, Q4_K, Q6_K over the embeddings, the LM head, then each layer's q, k, v,
    # o, gate, up and down: layer 0's are Q6_K Q4_0 Q4_K | Q6_K | Q4_0 Q4_K | Q6_K, layer 1's
    # Q4_0 Q4_K Q6_K | Q4_0 | Q4_K Q6_K | Q4_0.
    assert linears == {
        "layers.0.qkv_proj": torch.nn.Linear,
        "layers.0.o_proj": torch.nn.Linear,
        "layers.0.mlp.gate_up_proj": Int4Linear,
        "layers.0.mlp.down_proj": torch.nn.Linear,
        "layers.1.qkv_proj": torch.nn.Linear,
        "layers.1.o_proj": Int4Linear,
        "layers.1.mlp.gate_up_proj": torch.nn.Linear,
        "layers.1.mlp.down_proj": Int4Linear,
    }


def test_an_moe_keeps_its_attention_blocks_and_leaves_router_and_experts_float(tmp_path: Path) -> None:
    """Every matrix Q4_0: the attention linears are kept, the router and experts are not (they
    are no decoder linear a quantization keeps), and are loaded as floats, not left unallocated."""
    path = write_gguf(tmp_path / "moe.gguf", "qwen3moe", types=["Q4_0"], seed=6, realistic=True)
    cfg = ModelConfig.from_dir(converted_dir(path, torch.float32))
    assert GgufBlocks(path, cfg, TpShard(0, 1)).weights == {
        f"layers.{i}.{m}.weight" for i in range(2) for m in ("qkv_proj", "o_proj")
    }
    kept, n = tokens_and_count(path, Int4Linear, "neo")
    dequantized, _ = tokens_and_count(path, Int4Linear, "neo", quantization="none")
    assert n == 4 and kept == dequantized


def test_other_methods_on_a_gguf_and_gguf_without_one(files, checkpoints) -> None:
    with LLM(str(files["llama"]), dtype="float32", num_gpu_blocks=16, quantization="int8") as llm:
        assert isinstance(llm.engine.runner.model.decoder_layers[0].qkv_proj, Int8Linear)
    with pytest.raises(InvalidArgumentError, match="quantization 'gguf' needs a .gguf model"):
        LLM(str(checkpoints["llama"]), quantization="gguf")
