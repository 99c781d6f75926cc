"""Weight-only int8 linears (``--quantization int8``): the kernel against its dequantized weight,
the engine against the same model with every int8 weight dequantized into a float checkpoint (our
own dequantize-then-float path, token for token, in every offload mode), the bytes it keeps, and
the refusals: an unknown method, a checkpoint's ``quantization_config``."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from conftest import assert_all_blocks_free
from neo_rs import LLM, InvalidArgumentError, SamplingParams
from neo_rs.errors import ModelLoadError
from neo_rs.model.quant import Int8Linear, quantize_int8
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


def dequantized_checkpoint(src: Path, dst: Path) -> Path:
    """``src`` with each decoder linear's weight replaced by its int8 round trip: what the
    quantized engine computes with, as a float checkpoint."""
    shutil.copytree(src, dst)
    weights = load_file(dst / "model.safetensors")
    for name, w in weights.items():
        if ".layers." in name and name.endswith("_proj.weight"):
            q, scale = quantize_int8(w)
            weights[name] = (q.float() * scale[:, None]).to(w.dtype)
    save_file(weights, dst / "model.safetensors", metadata={"format": "pt"})
    return dst


MODES = {
    "none": dict(offload="none", num_gpu_blocks=8, block_size=8, num_cpu_blocks=64),
    "neo": dict(offload="neo", num_gpu_blocks=8, block_size=8, num_cpu_blocks=64, neo_force_pipeline=True),
    "all": dict(offload="all", num_gpu_blocks=16, block_size=8, num_cpu_blocks=64),
}


@pytest.mark.parametrize("offload", list(MODES))
def test_int8_engine_matches_its_dequantized_checkpoint(checkpoints, tmp_path: Path, offload: str) -> None:
    path = checkpoints["qwen3"]  # q/k norms and biases around the quantized projections
    reference = dequantized_checkpoint(path, tmp_path / "dequantized")

    def tokens(model: Path, **kw: object) -> list[list[int]]:
        with LLM(str(model), dtype="float32", **MODES[offload], **kw) as llm:
            outs = llm.generate(PROMPTS, GREEDY, use_tqdm=False)
            assert_all_blocks_free(llm.engine)
            if kw:
                layer = llm.engine.runner.model.decoder_layers[0]
                assert isinstance(layer.qkv_proj, Int8Linear) and isinstance(layer.mlp.down_proj, Int8Linear)
            return [o.outputs[0].token_ids for o in outs]

    assert tokens(path, quantization="int8") == tokens(reference)


def test_int8_keeps_half_the_bytes_of_the_quantized_linears(checkpoints, monkeypatch) -> None:
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
    # int8 rows plus a bf16 scale each, against bf16 rows; the norms stay as they were.
    assert int8[0] <= 0.55 * dense[0], (int8, dense)
    assert int8[1] < dense[1]


def test_bad_quantization_is_refused(checkpoints, tmp_path: Path) -> None:
    with pytest.raises(InvalidArgumentError, match="quantization must be one of int8"):
        LLM(str(checkpoints["llama"]), quantization="int3")
    gptq = tmp_path / "gptq"
    shutil.copytree(checkpoints["llama"], gptq)
    cfg = json.loads((gptq / "config.json").read_text())
    cfg["quantization_config"] = {"quant_method": "gptq", "bits": 4, "group_size": 128}
    (gptq / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ModelLoadError, match="quantization_config 'gptq' is not supported"):
        LLM(str(gptq))
