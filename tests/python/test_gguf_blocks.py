"""A GGUF's blocks kept quantized (``--quantization gguf``, a .gguf model's default): Q4_0, Q4_1
and Q4_K (int4), Q8_0, Q5_0, Q5_1, Q5_K and Q6_K (grouped int8, in bf16 where our CPU kernel
runs) read as exactly what ``gguf`` dequantizes; each kept linear, placed as the loader places
the float weight (fused parts, llama.cpp's Q/K row order, tensor-parallel shards), multiplies by
that weight; the engine generates token for token as with the file dequantized (``--quantization
none``) in every offload mode, keeps int4's and int8's share of the bytes, fuses 4- and 6-bit
parts as grouped int8, leaves a linear with any other type (or, without the kernel, the 5- to
8-bit types) as floats, and refuses ``gguf`` without a GGUF."""

from __future__ import annotations

import logging
from pathlib import Path

import gguf
import pytest
import torch
from neo_rs import LLM, InvalidArgumentError, SamplingParams
from neo_rs.config import ModelConfig
from neo_rs.model import rust_linears
from neo_rs.model.gguf import converted_dir, dequantize, open_gguf
from neo_rs.model.gguf_blocks import KEPT_TYPES, GgufBlocks
from neo_rs.model.gguf_decode import INT4_TYPES, INT8_TYPES, decoded_blocks
from neo_rs.model.loader import load_model
from neo_rs.model.quant import GroupedInt8Linear, Int4Linear, Int8Linear, decoder_linears
from neo_rs.model.rust_linears import quant_kernel_applies
from neo_rs.parallel.group import SINGLE_PROCESS, TensorParallel
from neo_rs.parallel.shards import TpShard
from test_gguf import write_gguf
from test_quant import MODES, tokens_and_count

GREEDY = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
PROMPTS = [[256, 72, 105], list(range(10, 47)), [7], [5, 9, 200, 31] * 4]


@pytest.fixture(scope="module")
def files(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("gguf-blocks")
    kept = list(INT4_TYPES)
    return {
        # Llama: llama.cpp permuted its Q/K rows; Qwen2: QKV biases; Phi-3: fused QKV and gate/up.
        **{
            arch: write_gguf(root / f"{arch}.gguf", arch, types=kept, seed=3)
            for arch in ("llama", "qwen2", "phi3")
        },
        # Normal weights quantized by gguf: a model whose greedy tokens vary.
        "normal": write_gguf(root / "normal.gguf", types=["Q4_0", "Q4_1"], seed=5, realistic=True),
        # Every third matrix Q6_K: a fused linear with a Q6_K part stays float in float32, and
        # is kept as grouped int8 in bf16 (as a Q4_K_M file's Q4_K and Q6_K parts).
        "mixed": write_gguf(root / "mixed.gguf", types=["Q4_0", "Q4_K", "Q6_K"], seed=4),
        # The grouped int8 types (2 to 8 bits), on each architecture's placement.
        **{
            f"{arch}-int8": write_gguf(root / f"{arch}-int8.gguf", arch, types=list(INT8_TYPES), seed=7)
            for arch in ("llama", "qwen2", "phi3")
        },
        # Weights exact in bf16, so that the file dequantized to bf16 is the weight the kernel
        # multiplies by.
        "pow2": write_gguf(root / "pow2.gguf", types=["Q8_0", "Q5_0", "Q5_1", "Q6_K"], seed=8, pow2=True),
    }


# (q's dtype, its least and greatest value, the group) each type is read as.
FORMS = {
    **{kind: (torch.uint8, 0, 15, 32) for kind in INT4_TYPES},
    "Q8_0": (torch.int8, -128, 127, 32),
    "Q5_0": (torch.int8, -16, 15, 32),
    "Q5_1": (torch.int8, 0, 31, 32),
    "Q5_K": (torch.int8, 0, 31, 32),
    "Q2_K": (torch.int8, 0, 3, 16),
    "Q3_K": (torch.int8, -4, 3, 16),
    "Q6_K": (torch.int8, -32, 31, 16),
}
kernel = pytest.mark.skipif(
    not quant_kernel_applies(torch.device("cpu"), torch.bfloat16), reason="no AVX512_BF16"
)


@pytest.mark.parametrize("kind", KEPT_TYPES)
def test_blocks_are_what_gguf_dequantizes(files, kind: str) -> None:
    path = files["llama" if kind in INT4_TYPES else "llama-int8"]
    tensors = [t for t in open_gguf(path).tensors if t.tensor_type == gguf.GGMLQuantizationType[kind]]
    assert tensors
    dtype, least, greatest, group = FORMS[kind]
    for t in tensors:
        blocks = decoded_blocks(t)
        assert blocks.q.dtype == dtype and blocks.group == group and blocks.order is None
        # Random blocks reach every value of the type's range.
        assert (int(blocks.q.min()), int(blocks.q.max())) == (least, greatest), t.name
        assert torch.equal(blocks.dequantized(), dequantize(t)), t.name


@pytest.mark.parametrize(
    ("arch", "rank", "size"), [("llama", 0, 1), ("llama", 1, 2), ("qwen2", 0, 2), ("phi3", 1, 2)]
)
def test_each_kept_linear_multiplies_by_the_weight_the_loader_placed(
    files, arch: str, rank: int, size: int
) -> None:
    model, floats = _kept(files[arch], torch.float32, rank, size)
    for name, weight in floats.items():
        linear = model.get_submodule(name)
        assert isinstance(linear, Int4Linear), name
        eye = torch.eye(linear.in_features)
        got = linear(eye).t() - (0 if linear.bias is None else linear.bias[:, None])
        torch.testing.assert_close(got, weight, rtol=1e-6, atol=1e-7, msg=name)


def _kept(path: Path, dtype: torch.dtype, rank: int = 0, size: int = 1) -> tuple[torch.nn.Module, dict]:
    """Rank ``rank`` of ``size``'s model of GGUF ``path`` in ``dtype``, every decoder linear kept
    as the file's blocks (the grouped int8 types too, in bf16), and the float weights the loader
    placed for them."""
    model_dir = converted_dir(path, torch.float32)
    cfg = ModelConfig.from_dir(model_dir)
    shard = TpShard(rank, size)
    tp = SINGLE_PROCESS if size == 1 else TensorParallel(shard)
    model = load_model(model_dir, cfg, dtype, torch.device("cpu"), 64, tp)
    floats = {name: linear.weight.detach().clone() for name, _, _, linear in decoder_linears(model)}
    grouped_int8 = dtype == torch.bfloat16
    assert GgufBlocks(path, cfg, shard, grouped_int8).keep(model) == (len(floats), 0)
    return model, floats


def _multiplies_by(linear: GroupedInt8Linear, weight: torch.Tensor, name: str) -> None:
    """``linear`` (bf16) multiplies by ``weight`` (the file's, rounded to bf16 by the loader),
    within what the bf16 roundings can move it, each at most a ``2**-8`` of its value: the
    loader's of ``w``, the kernel's of the group's scale and zero (``|q * scale| <= |w| +
    |zero|``), and that of the output ``w + bias``."""
    eye = torch.eye(linear.in_features, dtype=torch.bfloat16)
    bias = 0 if linear.bias is None else linear.bias.float()[:, None]
    got = linear(eye).float().t() - bias
    zero = linear.scales_zeros[..., 1].float().t().repeat_interleave(linear.group, dim=1).abs()
    w = weight.float()
    bound = (3 * w.abs() + 2 * zero + abs(bias)) * 2**-8
    assert ((got - w).abs() <= bound).all(), (name, ((got - w).abs() - bound).max())


@kernel
@pytest.mark.parametrize(
    ("arch", "rank", "size"), [("llama", 0, 1), ("llama", 1, 2), ("qwen2", 0, 2), ("phi3", 1, 2)]
)
def test_each_grouped_int8_linear_multiplies_by_the_weight_the_loader_placed(
    files, arch: str, rank: int, size: int
) -> None:
    model, floats = _kept(files[f"{arch}-int8"], torch.bfloat16, rank, size)
    for name, weight in floats.items():
        linear = model.get_submodule(name)
        assert isinstance(linear, GroupedInt8Linear) and linear.gemm is not None, name
        _multiplies_by(linear, weight, name)


@kernel
def test_a_linear_of_4_and_6_bit_parts_is_kept_as_grouped_int8(files) -> None:
    """As a Q4_K_M file fuses Q4_K q and k with a Q6_K v: the int4 parts widened to int8, their
    groups of 32 split in 16s (Q6_K's)."""
    model, floats = _kept(files["mixed"], torch.bfloat16)
    # The types of test_a_linear_with_another_type_stays_float.
    int8 = {"layers.0.qkv_proj", "layers.0.o_proj", "layers.0.mlp.down_proj", "layers.1.qkv_proj"}
    int8 |= {"layers.1.mlp.gate_up_proj"}
    assert {n for n in floats if isinstance(model.get_submodule(n), GroupedInt8Linear)} == int8
    for name in int8:
        linear = model.get_submodule(name)
        assert isinstance(linear, GroupedInt8Linear) and linear.group == 16, name
        _multiplies_by(linear, floats[name], name)
    for name in set(floats) - int8:
        assert isinstance(model.get_submodule(name), Int4Linear), name


def _tokens(path: Path, offload: str, **kw: object) -> tuple[list[list[int]], int]:
    """Greedy tokens of ``PROMPTS`` in bf16 (every block back in its pool), and how many
    ``GroupedInt8Linear`` the model holds."""
    return tokens_and_count(path, GroupedInt8Linear, offload, dtype="bfloat16", **kw)


@kernel
@pytest.mark.parametrize("offload", list(MODES))
def test_kept_int8_blocks_generate_like_the_file_dequantized(files, offload: str) -> None:
    """Weights exact in bf16: the kernel and oneDNN multiply by the same values, summed in f32."""
    kept, n = _tokens(files["pow2"], offload)
    dequantized, none = _tokens(files["pow2"], offload, quantization="none")
    assert (n, none) == (8, 0)
    assert kept == dequantized
    assert len({t for seq in kept for t in seq}) > 3


@kernel
def test_kept_int8_blocks_take_int8s_share_of_the_bytes(files, monkeypatch) -> None:
    monkeypatch.setenv("NEO_RS_PACK_LINEARS", "0")  # oneDNN's packed bf16 weights are not in state_dict

    def layer_bytes(quantization: str | None) -> int:
        path = str(files["llama-int8"])
        with LLM(path, dtype="bfloat16", num_gpu_blocks=16, quantization=quantization) as llm:
            return sum(
                t.numel() * t.element_size() for t in llm.engine.runner.model.layers.state_dict().values()
            )

    # 8 bits a weight and a bf16 scale and zero per group: at most 10 bits of bf16's 16 (Q6_K's
    # groups of 16), the norms as they were.
    assert layer_bytes(None) <= 0.63 * layer_bytes("none")


def test_without_the_kernel_the_grouped_int8_types_are_dequantized_and_said(
    files, caplog, monkeypatch
) -> None:
    monkeypatch.setenv("NEO_RS_ROW_GEMV", "0")  # our kernel off, as on a CPU without AVX512_BF16
    with (
        caplog.at_level(logging.WARNING),
        LLM(str(files["llama-int8"]), dtype="bfloat16", num_gpu_blocks=16) as llm,
    ):
        assert not any(isinstance(m, GroupedInt8Linear) for m in llm.engine.runner.model.modules())
    said = [r.getMessage() for r in caplog.records if "dequantized" in r.getMessage()]
    assert said == [
        "the GGUF's Q2_K/Q3_K/Q5_0/Q5_1/Q5_K/Q6_K/Q8_0 linears are dequantized to torch.bfloat16: only "
        "our kernels keep them (CUDA, or a CPU with AVX512_BF16)"
    ]


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


def test_a_linear_with_another_type_stays_float(files, monkeypatch) -> None:
    # Grouped int8 off (as on AVX2 alone): its Q6_K parts are not kept, nor the linears they join.
    monkeypatch.setattr(rust_linears, "gemv_path", lambda: "avx2")
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
    assert GgufBlocks(path, cfg, TpShard(0, 1), grouped_int8=True).weights == {
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
