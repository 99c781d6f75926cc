"""Weight-only int8, int4 and FP8 linears (``--quantization int8|int4|fp8``): each kernel against its
dequantized weight, the engine against the same model with every quantized weight dequantized
into a float checkpoint (our own dequantize-then-float path, token for token, in every offload
mode), the bytes each keeps, and the refusals: an unknown method, widths int4's kernel cannot
take, a ``quantization_config`` we do not load."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from conftest import assert_all_blocks_free
from neo_rs import LLM, InvalidArgumentError, SamplingParams
from neo_rs.config import ModelConfig
from neo_rs.errors import ModelLoadError
from neo_rs.model.fp8 import FP8, Fp8Linear, quantize_fp8, widen
from neo_rs.model.loader import load_model, shard_files
from neo_rs.model.prequantized import quantize_at_load
from neo_rs.model.quant import (
    Int4Linear,
    Int8Linear,
    int4_group_size,
    quantize_int4,
    quantize_int8,
    quantizer,
)
from neo_rs.parallel.group import TensorParallel
from neo_rs.parallel.shards import TpShard
from safetensors.torch import load_file, save_file
from torch import nn

GREEDY = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
PROMPTS = [[256, 72, 105], list(range(10, 47)), [7], [5, 9, 200, 31] * 4]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_int8_linear_multiplies_by_its_dequantized_weight(dtype: torch.dtype) -> None:
    torch.manual_seed(0)
    linear = nn.Linear(96, 40, bias=True).to(dtype)
    with torch.no_grad():
        linear.weight[3] = 0  # an all-zero row: scale 0, zeros out
    q = Int8Linear(linear)
    assert q.weight.dtype == torch.int8 and q.scales.dtype == dtype and q.scales[3] == 0
    x = torch.randn(2, 5, 96).to(dtype)
    want = torch.nn.functional.linear(x.float(), q.dequantized().float(), linear.bias.float())
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(q(x).float(), want, atol=tol, rtol=tol)
    # The rounding: within half a step of the float weight, every row (before the scales are
    # rounded to the model dtype).
    w = linear.weight.detach().float()
    q8, scale = quantize_int8(w)
    assert ((q8.float() * scale[:, None] - w).abs() <= scale[:, None] / 2 + 1e-7).all()


def test_quantize_rounds_half_to_even_and_clamps() -> None:
    w = torch.tensor([[127.0, 0.5, 1.5, -2.5, -127.0]])
    q, scale = quantize_int8(w)
    assert scale.item() == 1.0 and q.tolist() == [[127, 0, 2, -2, -127]]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_int4_linear_multiplies_by_its_dequantized_weight(dtype: torch.dtype) -> None:
    torch.manual_seed(0)
    linear = nn.Linear(192, 48, bias=True).to(dtype)  # 192 columns: groups of 64
    with torch.no_grad():
        linear.weight[5, 64:128] = 0.25  # a constant group: scale 0, its value kept
    q4 = Int4Linear(linear)
    assert q4.group == 64 and q4.scales_zeros.shape == (3, 48, 2) and q4.scales_zeros.dtype == dtype
    q, scale, zero = quantize_int4(linear.weight, 64)
    x = torch.randn(2, 5, 192).to(dtype)
    want = torch.nn.functional.linear(x.float(), q4.dequantized(q).float(), linear.bias.float())
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(q4(x).float(), want, atol=tol, rtol=tol)
    # The rounding: within half a step of the float weight, every group (before the scales are
    # rounded to the model dtype).
    w = linear.weight.detach().float().reshape(48, 3, 64)
    back = (q.float().reshape(48, 3, 64) - 8) * scale[..., None] + zero[..., None]
    assert ((back - w).abs() <= scale[..., None] / 2 + 1e-6).all()
    assert scale[5, 1] == 0 and (back[5, 1] == 0.25).all()


def test_fp8_widens_every_value_exactly_and_rounds_within_its_precision() -> None:
    every = torch.arange(256, dtype=torch.uint8).view(FP8)
    finite = every.float().isfinite()
    assert torch.equal(widen(every).float()[finite] * 2**8, every.float()[finite])
    torch.manual_seed(0)
    w = torch.randn(40, 96) * torch.logspace(-3, 1, 96)  # columns across e4m3's range
    w[3] = 0  # an all-zero row: scale 0, zeros out
    q, scale = quantize_fp8(w)
    assert q.dtype == FP8 and scale[3] == 0 and (q[3].float() == 0).all()
    # Three mantissa bits: within 2^-4 of each weight, or of e4m3's smallest step for tiny ones.
    back = q.float() * scale[:, None]
    assert ((back - w).abs() <= torch.maximum(w.abs() / 16, scale[:, None] * 2**-9)).all()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_fp8_linear_multiplies_by_its_dequantized_weight(dtype: torch.dtype) -> None:
    torch.manual_seed(0)
    linear = nn.Linear(96, 40, bias=True).to(dtype)
    f8 = Fp8Linear(linear)
    assert f8.weight.dtype == FP8 and not f8.scaled_mm  # weight-only on the CPU
    x = torch.randn(2, 5, 96).to(dtype)
    want = torch.nn.functional.linear(x.float(), f8.dequantized(), linear.bias.float())
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(f8(x).float(), want, atol=tol, rtol=tol)


def test_int4_refuses_widths_its_kernel_cannot_take() -> None:
    with pytest.raises(ModelLoadError, match="input widths in multiples of 32"):
        Int4Linear(nn.Linear(48, 32))
    with pytest.raises(ModelLoadError, match="output widths in multiples of 16; a linear has 24"):
        Int4Linear(nn.Linear(64, 24))


def round_trip(w: torch.Tensor, method: str) -> torch.Tensor:
    """``w`` as ``method`` keeps it, dequantized (float32)."""
    if method in ("int8", "fp8"):
        q, scale = (quantize_int8 if method == "int8" else quantize_fp8)(w)
        return q.float() * scale[:, None]
    group = int4_group_size(w.shape[1])
    assert group is not None
    q, scale, zero = quantize_int4(w, group)
    groups = (q.float().reshape(w.shape[0], -1, group) - 8) * scale[..., None] + zero[..., None]
    return groups.reshape(w.shape)


def dequantized_checkpoint(src: Path, dst: Path, method: str) -> Path:
    """``src`` with each decoder linear's weight replaced by its ``method`` round trip: what the
    quantized engine computes with, as a float checkpoint."""
    shutil.copytree(src, dst)
    weights = load_file(dst / "model.safetensors")
    for name, w in weights.items():
        if ".layers." in name and name.endswith("_proj.weight"):
            weights[name] = round_trip(w, method).to(w.dtype)
    save_file(weights, dst / "model.safetensors", metadata={"format": "pt"})
    return dst


MODES = {
    "none": dict(offload="none", num_gpu_blocks=8, block_size=8, num_cpu_blocks=64),
    "neo": dict(offload="neo", num_gpu_blocks=8, block_size=8, num_cpu_blocks=64, neo_force_pipeline=True),
    "all": dict(offload="all", num_gpu_blocks=16, block_size=8, num_cpu_blocks=64),
}


def tokens_and_count(
    model: Path, kind: type, offload: str, dtype: str = "float32", **kw: object
) -> tuple[list[list[int]], int]:
    """Greedy tokens of ``PROMPTS`` on ``model`` in ``dtype``, in ``MODES[offload]`` (every block
    back in its pool after), and how many ``kind`` modules its model holds."""
    with LLM(str(model), dtype=dtype, **MODES[offload], **kw) as llm:
        outs = llm.generate(PROMPTS, GREEDY, use_tqdm=False)
        assert_all_blocks_free(llm.engine)
        count = sum(isinstance(m, kind) for m in llm.engine.runner.model.modules())
        return [o.outputs[0].token_ids for o in outs], count


@pytest.mark.parametrize("method", ["int8", "int4", "fp8"])
@pytest.mark.parametrize("offload", list(MODES))
def test_engine_matches_its_dequantized_checkpoint(
    checkpoints, tmp_path: Path, offload: str, method: str
) -> None:
    path = checkpoints["qwen3"]  # q/k norms and biases around the quantized projections
    reference = dequantized_checkpoint(path, tmp_path / "dequantized", method)
    kind = {"int8": Int8Linear, "int4": Int4Linear, "fp8": Fp8Linear}[method]

    kept, count = tokens_and_count(path, kind, offload, quantization=method)
    assert count == 8  # 2 layers of QKV, O, gate/up and down
    assert kept == tokens_and_count(reference, kind, offload)[0]


@pytest.mark.parametrize("rank", [0, 1])
def test_each_rank_quantizes_its_own_slices_at_load(checkpoints, rank: int) -> None:
    """Quantized at load from the checkpoint, one linear at a time on the host: each rank's int8
    linears are its float slices quantized (fused parts, row- and column-parallel)."""
    path, shard = checkpoints["qwen2"], TpShard(rank, 2)
    cfg, tp, cpu = ModelConfig.from_dir(path), TensorParallel(shard), torch.device("cpu")
    model = load_model(path, cfg, torch.float32, cpu, 64, tp, quantize_later=True)
    assert quantize_at_load(model, shard_files(path), cfg, shard, quantizer("int8")) == 8
    reference = load_model(path, cfg, torch.float32, cpu, 64, tp)
    for name in [
        f"layers.{i}.{m}"
        for i in range(2)
        for m in ("qkv_proj", "o_proj", "mlp.gate_up_proj", "mlp.down_proj")
    ]:
        got, want = model.get_submodule(name), reference.get_submodule(name).weight
        assert isinstance(got, Int8Linear), name
        torch.testing.assert_close(got.dequantized(), round_trip(want, "int8"), rtol=0, atol=0, msg=name)


def test_the_quantized_linears_keep_their_share_of_the_bytes(checkpoints, monkeypatch) -> None:
    monkeypatch.setenv("NEO_RS_PACK_LINEARS", "0")  # oneDNN's packed bf16 weights are not in state_dict

    def bytes_of(llm: LLM) -> tuple[int, int]:
        model = llm.engine.runner.model
        layers = sum(t.numel() * t.element_size() for t in model.layers.state_dict().values())
        total = sum(t.numel() * t.element_size() for t in model.state_dict().values())
        return layers, total

    with LLM(str(checkpoints["llama3"]), dtype="bfloat16", num_gpu_blocks=16) as llm:
        dense = bytes_of(llm)
    with LLM(str(checkpoints["llama3"]), dtype="bfloat16", num_gpu_blocks=16, quantization="int8") as llm:
        int8 = bytes_of(llm)
    with LLM(str(checkpoints["llama3"]), dtype="bfloat16", num_gpu_blocks=16, quantization="int4") as llm:
        int4 = bytes_of(llm)
    with LLM(str(checkpoints["llama3"]), dtype="bfloat16", num_gpu_blocks=16, quantization="fp8") as llm:
        fp8 = bytes_of(llm)
    # int8 rows plus a bf16 scale each, int4 ones plus a bf16 scale and zero per group of 64,
    # against bf16 rows; the norms stay as they were.
    assert int8[0] <= 0.55 * dense[0], (int8, dense)
    assert fp8[0] <= 0.55 * dense[0], (fp8, dense)  # e4m3 rows plus a float32 scale each
    assert int4[0] <= 0.35 * dense[0], (int4, dense)
    assert int4[1] < int8[1] < dense[1]


def test_bad_quantization_is_refused(checkpoints, tmp_path: Path) -> None:
    with pytest.raises(InvalidArgumentError, match="quantization must be one of int8, int4"):
        LLM(str(checkpoints["llama"]), quantization="int3")
    bnb = tmp_path / "bnb"
    shutil.copytree(checkpoints["llama"], bnb)
    cfg = json.loads((bnb / "config.json").read_text())
    cfg["quantization_config"] = {"quant_method": "bitsandbytes", "load_in_4bit": True}
    (bnb / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ModelLoadError, match="quantization_config 'bitsandbytes' is not supported"):
        LLM(str(bnb))
