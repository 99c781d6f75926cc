"""FP8 checkpoints as three writers store them (compressed-tensors' float-quantized format, vLLM's
and transformers' ``fp8``, ``fbgemm_fp8``), with a scale per channel, per tensor or per block (of
rows and columns that divide no width of the model, so every edge block is short): each rank
places the e4m3 rows and their scales as the float weight would be placed (a fused linear's
parts keeping their own per-tensor scales), and the engine keeps them (inferred from
``quantization_config``) and generates token for token as the float checkpoint of those weights
in every offload mode, and as that checkpoint dequantized with ``--quantization none``; what we
cannot load is named."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from neo_rs import LLM, SamplingParams
from neo_rs.config import ModelConfig
from neo_rs.errors import ModelLoadError
from neo_rs.model.fp8 import FP8, FP8_MAX, Fp8Linear
from neo_rs.model.fp8_checkpoint import load_fp8_linears
from neo_rs.model.loader import load_model, shard_files
from neo_rs.parallel.group import TensorParallel
from neo_rs.parallel.shards import TpShard
from safetensors.torch import load_file, save_file
from test_quant import MODES, tokens_and_count

GREEDY = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
PROMPTS = [[256, 72, 105], list(range(10, 47)), [7], [5, 9, 200, 31] * 4]


# The blocks of the block-wise checkpoints (rows, input columns): no width of the test models is a
# multiple of 48, and a row-parallel rank's share of 64 or 128 columns starts on a 32.
BLOCK = (48, 48)
TP_BLOCK = (48, 32)


def quant_config(kind: str, strategy: str, block: tuple[int, int] = BLOCK) -> dict:
    if kind == "compressed-tensors":
        weights = {"num_bits": 8, "type": "float", "strategy": strategy, "symmetric": True, "dynamic": False}
        if strategy == "block":
            weights["block_structure"] = list(block)
        tokens = {"num_bits": 8, "type": "float", "strategy": "token", "dynamic": True}
        group = {"targets": ["Linear"], "weights": weights, "input_activations": tokens}
        return {
            "quant_method": "compressed-tensors",
            "format": "float-quantized",
            "config_groups": {"group_0": group},
            "ignore": ["lm_head"],
        }
    if kind == "fbgemm_fp8":
        return {"quant_method": "fbgemm_fp8", "activation_scale_ub": 1200.0}
    if strategy == "block":
        return {"quant_method": "fp8", "activation_scheme": "dynamic", "weight_block_size": list(block)}
    return {"quant_method": "fp8", "activation_scheme": "static"}


def _quantized(
    w: torch.Tensor, strategy: str, block: tuple[int, int]
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``w`` as e4m3, its scales (per channel ``[out, 1]``, per tensor ``[1]``, per block
    ``[ceil(out / rows), ceil(in / columns)]``) and the float32 weight they stand for."""
    w = w.float()
    if strategy == "block":
        rows, cols = block
        pad = w.new_zeros(-(-w.shape[0] // rows) * rows, -(-w.shape[1] // cols) * cols)
        pad[: w.shape[0], : w.shape[1]] = w
        tiles = pad.view(pad.shape[0] // rows, rows, pad.shape[1] // cols, cols)
        scale = tiles.abs().amax(dim=(1, 3)) / FP8_MAX
        each = scale.repeat_interleave(rows, dim=0).repeat_interleave(cols, dim=1)[: w.shape[0], : w.shape[1]]
    elif strategy == "channel":
        scale = w.abs().amax(dim=1, keepdim=True) / FP8_MAX
        each = scale
    else:
        scale = w.abs().amax().reshape(1) / FP8_MAX
        each = scale[:, None]
    q = (w / each).to(FP8)
    return q, scale, q.float() * each


def write_fp8(
    src: Path, root: Path, kind: str, strategy: str, block: tuple[int, int] = BLOCK
) -> tuple[Path, Path]:
    """``src`` with its decoder linears in e4m3 and a ``weight_scale`` per channel, per tensor or
    per ``block`` (``fp8``'s blocks: ``weight_scale_inv``; its other scales: with a static
    ``input_scale`` too), and the float checkpoint of those weights."""
    fp8_dir, float_dir = root / f"{kind}-{strategy}", root / f"{kind}-{strategy}-float"
    for d in (fp8_dir, float_dir):
        shutil.copytree(src, d)
    quantized, floats = {}, {}
    for name, w in load_file(src / "model.safetensors").items():
        if ".layers." in name and name.endswith("_proj.weight"):
            q, scale, floats[name] = _quantized(w, strategy, block)
            module = name.removesuffix(".weight")
            inverse = kind == "fp8" and strategy == "block"
            quantized[name], quantized[f"{module}.weight_scale{'_inv' if inverse else ''}"] = q, scale
            if kind == "fp8" and not inverse:
                quantized[f"{module}.input_scale"] = torch.tensor([0.05])
        else:
            quantized[name] = floats[name] = w
    save_file(quantized, fp8_dir / "model.safetensors", metadata={"format": "pt"})
    save_file(floats, float_dir / "model.safetensors", metadata={"format": "pt"})
    cfg = json.loads((fp8_dir / "config.json").read_text())
    cfg["quantization_config"] = quant_config(kind, strategy, block)
    (fp8_dir / "config.json").write_text(json.dumps(cfg))
    return fp8_dir, float_dir


@pytest.mark.parametrize(
    ("kind", "strategy", "block", "rank", "kept"),
    [
        ("compressed-tensors", "channel", BLOCK, 0, 8),
        ("compressed-tensors", "tensor", BLOCK, 1, 8),
        ("fp8", "block", TP_BLOCK, 1, 8),
        ("compressed-tensors", "block", TP_BLOCK, 0, 8),
        # Rank 1's share of O's 64 and down's 128 input columns starts on no block of 48: dequantized.
        ("fp8", "block", BLOCK, 1, 4),
        ("fp8", "block", BLOCK, 0, 8),
    ],
)
def test_each_rank_places_the_rows_and_their_scales(
    checkpoints, tmp_path, kind: str, strategy: str, block: tuple[int, int], rank: int, kept: int
) -> None:
    fp8, floats = write_fp8(checkpoints["qwen2"], tmp_path, kind, strategy, block)
    cfg, shard = ModelConfig.from_dir(fp8), TpShard(rank, 2)
    assert cfg.quantized_checkpoint is not None
    tp = TensorParallel(shard)
    model = load_model(fp8, cfg, torch.float32, torch.device("cpu"), 64, tp)
    files, blocks = shard_files(fp8), cfg.quantized_checkpoint.block
    assert blocks == (block if strategy == "block" else None)
    assert load_fp8_linears(model, files, cfg, shard, True, False, blocks) == (kept, 8 - kept)
    reference = load_model(floats, ModelConfig.from_dir(floats), torch.float32, torch.device("cpu"), 64, tp)
    linears = ("qkv_proj", "o_proj", "mlp.gate_up_proj", "mlp.down_proj")
    for name in [f"layers.{i}.{m}" for i in range(2) for m in linears]:
        linear, want = model.get_submodule(name), reference.get_submodule(name)
        if isinstance(linear, Fp8Linear):
            assert linear.weight.dtype == FP8, name
            got = linear.dequantized()
        else:
            assert kept < 8 and name.endswith(("o_proj", "down_proj")), name
            got = linear.weight
        torch.testing.assert_close(got, want.weight, rtol=1e-6, atol=1e-7, msg=name)


KINDS = {
    "compressed-tensors-channel": ("compressed-tensors", "channel"),
    "fp8-tensor": ("fp8", "tensor"),
    "fbgemm-channel": ("fbgemm_fp8", "channel"),
    "fp8-block": ("fp8", "block"),
    "compressed-tensors-block": ("compressed-tensors", "block"),
}


@pytest.mark.parametrize("offload", list(MODES))
@pytest.mark.parametrize("kind", list(KINDS))
def test_engine_generates_like_the_float_checkpoint_of_its_weights(
    checkpoints, tmp_path, kind: str, offload: str
) -> None:
    fp8, floats = write_fp8(checkpoints["qwen2"], tmp_path, *KINDS[kind])
    want, _ = tokens_and_count(floats, Fp8Linear, offload)
    # Inferred from quantization_config (2 layers of 4 linears), then dequantized at load.
    assert tokens_and_count(fp8, Fp8Linear, offload) == (want, 8)
    assert tokens_and_count(fp8, Fp8Linear, offload, quantization="none") == (want, 0)


def test_what_we_cannot_load_is_named(checkpoints, tmp_path) -> None:
    fp8, _ = write_fp8(checkpoints["llama"], tmp_path, "compressed-tensors", "channel")
    base = json.loads((fp8 / "config.json").read_text())
    group = base["quantization_config"]["config_groups"]["group_0"]
    int4 = {**group, "weights": {"num_bits": 4, "type": "int", "strategy": "group", "group_size": 128}}
    blocks = {**group, "weights": {**group["weights"], "strategy": "block", "block_structure": [0, 128]}}
    for quant, match in [
        ({"quant_method": "fp8", "weight_block_size": [128]}, r"weight_block_size \[128\]: a block of"),
        # The file's scales are per channel, not [ceil(out / 32), ceil(in / 32)].
        (
            {"quant_method": "fp8", "weight_block_size": [32, 32]},
            r"layers.0.self_attn.\w_proj: .*blocks of 32 x 32.* weight_scale \(64, 1\)",
        ),
        (
            {**base["quantization_config"], "config_groups": {"group_0": blocks}},
            "config_groups.group_0.weights.block_structure",
        ),
        ({**base["quantization_config"], "format": "pack-quantized"}, "format 'pack-quantized'"),
        (
            {**base["quantization_config"], "config_groups": {"group_0": int4}},
            "config_groups.group_0.weights",
        ),
    ]:
        (fp8 / "config.json").write_text(json.dumps({**base, "quantization_config": quant}))
        with pytest.raises(ModelLoadError, match=match):
            LLM(str(fp8), num_gpu_blocks=8)
