"""GPTQ and AWQ checkpoints (4 bits; GPTQ's 8 too), written here from integer weights packed by
the formats' own rules (restated below, independently of ``model/gptq_awq.py``): each packed
linear reads back as exactly ``(q - zero) * scale``; placed on each tensor-parallel rank as the
float weight would be; the engine keeps them as int4 (8 bits: grouped int8, in bf16 where our
CPU kernel runs, else dequantized; inferred from ``quantization_config``) and generates token for
token as the float checkpoint of those weights, in every offload mode, and as that checkpoint
dequantized with ``--quantization none``; fields we cannot load are named."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import NamedTuple

import numpy as np
import pytest
import torch
from neo_rs import LLM, InvalidArgumentError, SamplingParams
from neo_rs.config import ModelConfig
from neo_rs.errors import ModelLoadError
from neo_rs.model.gptq_awq import blocks_of, load_packed_linears
from neo_rs.model.loader import load_model, shard_files
from neo_rs.model.quant import GroupedInt8Linear, Int4Linear, grouped_int8_runs
from neo_rs.model.rust_linears import quant_kernel_applies
from neo_rs.parallel.group import SINGLE_PROCESS, TensorParallel
from neo_rs.parallel.shards import TpShard
from neo_rs.quantized_checkpoint import QuantizedCheckpoint
from safetensors.torch import load_file, save_file
from test_quant import MODES, tokens_and_count

GREEDY = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
PROMPTS = [[256, 72, 105], list(range(10, 47)), [7], [5, 9, 200, 31] * 4]
AWQ_ORDER = [0, 2, 4, 6, 1, 3, 5, 7]  # nibble i of an AWQ word holds column 8j + AWQ_ORDER[i]


def _words(values: np.ndarray, bits: int = 4) -> torch.Tensor:
    """uint ``[..., p n]`` values of ``bits`` -> int32 ``[..., n]`` (``p = 32 / bits``), value
    ``k`` of each ``p`` in bits ``bits * k`` up."""
    per = 32 // bits
    v = (values.astype(np.int64) & ((1 << bits) - 1)).astype(np.uint64).reshape(*values.shape[:-1], -1, per)
    word = sum(v[..., k] << np.uint64(bits * k) for k in range(per))
    return torch.from_numpy(np.ascontiguousarray(word.astype(np.uint32)).view(np.int32))


class Packed(NamedTuple):
    """A linear quantized: ``q`` [out, in], ``zeros`` and ``scales`` [out, groups], ``g_idx`` [in]
    (each input column's group)."""

    q: np.ndarray
    zeros: np.ndarray
    scales: np.ndarray
    g_idx: np.ndarray
    bits: int = 4

    def weight(self) -> torch.Tensor:
        """What it stands for: ``(q - zero) * scale``, each column with its group's."""
        w = (self.q - self.zeros[:, self.g_idx]) * self.scales[:, self.g_idx]
        return torch.from_numpy(w.astype(np.float32))

    def tensors(self, method: str, v1: bool = True) -> dict[str, torch.Tensor]:
        """As the format stores it."""
        q, zeros = self.q, self.zeros
        tensors = {"scales": torch.from_numpy(np.ascontiguousarray(self.scales.T.astype(np.float16)))}
        if method == "gptq":
            tensors["qweight"] = _words(q, self.bits).t().contiguous()
            tensors["qzeros"] = _words(zeros.T - int(v1), self.bits)
            tensors["g_idx"] = torch.from_numpy(self.g_idx.astype(np.int32))
        else:
            order = [8 * j + k for j in range(q.shape[0] // 8) for k in AWQ_ORDER]
            tensors["qweight"] = _words(q.T[:, order])
            tensors["qzeros"] = _words(zeros.T[:, order])
        return tensors


def quantize(
    w: torch.Tensor,
    group: int,
    rng: np.random.Generator,
    v1: bool,
    order: np.ndarray | None = None,
    bits: int = 4,
    pow2: bool = False,
) -> Packed:
    """Round-to-nearest ``bits`` with an integer zero per group, some at the ends of its range
    (from 1 in GPTQ's original format: a zero of 0, stored less one, would read back as 2^bits);
    the groups run over the columns in ``order`` (act-order), else in turn. ``pow2``: scales
    that are powers of two, so that 8-bit weights, ``(q - zero) * scale`` with ``|q - zero| <
    256``, are exact in bf16."""
    out, cols = w.shape
    top = (1 << bits) - 1
    order = np.arange(cols) if order is None else order
    g = w.float().numpy()[:, order].reshape(out, cols // group, group)
    lo, hi = g.min(-1), g.max(-1)
    scales = ((hi - lo) / top).astype(np.float16).astype(np.float32)
    if pow2:
        scales = np.exp2(np.round(np.log2(scales))).astype(np.float32)
    zeros = np.clip(np.round(-lo / scales), int(v1), top).astype(np.int64)
    ends = rng.random(zeros.shape)
    zeros[ends < 0.05], zeros[ends > 0.95] = int(v1), top
    in_order = np.clip(np.round(g / scales[..., None]) + zeros[..., None], 0, top).astype(np.int64)
    q, g_idx = np.empty((out, cols), np.int64), np.empty(cols, np.int64)
    q[:, order], g_idx[order] = in_order.reshape(out, cols), np.arange(cols) // group
    return Packed(q, zeros, scales, g_idx, bits)


def write_packed(
    src: Path,
    root: Path,
    method: str,
    group: int,
    v1: bool = True,
    act_order: str | None = None,
    bits: int = 4,
    pow2: bool = False,
) -> tuple[Path, Path]:
    """``src`` with its decoder linears packed (``method``, ``bits``, ``pow2``: see
    ``quantize``), and the float checkpoint of exactly the weights they pack. ``act_order``:
    "shared", one column order per input (as GPTQ's, from the input's statistics), or "own", one
    per linear (a fused linear's parts then differ)."""
    rng = np.random.default_rng(0)
    tag = f"{method}-{group}-{v1}-{act_order}-{bits}-{pow2}"
    packed_dir, float_dir = root / tag, root / f"{tag}-float"
    for d in (packed_dir, float_dir):
        shutil.copytree(src, d)
    weights = load_file(src / "model.safetensors")
    packed, floats = {}, {}
    shared: dict[int, np.ndarray] = {}
    for name, w in weights.items():
        if ".layers." in name and name.endswith("_proj.weight"):
            cols = w.shape[1]
            order = None
            if act_order is not None:
                own = rng.permutation(cols)
                order = shared.setdefault(cols, own) if act_order == "shared" else own
            linear = quantize(w, cols if group == -1 else group, rng, v1, order, bits, pow2)
            module = name.removesuffix(".weight")
            for suffix, t in linear.tensors(method, v1).items():
                packed[f"{module}.{suffix}"] = t
            floats[name] = linear.weight()
        else:
            packed[name] = floats[name] = w
    save_file(packed, packed_dir / "model.safetensors", metadata={"format": "pt"})
    save_file(floats, float_dir / "model.safetensors", metadata={"format": "pt"})
    cfg = json.loads((packed_dir / "config.json").read_text())
    quant = {"quant_method": method, "bits": bits, "group_size": group, "desc_act": act_order is not None}
    quant |= {"sym": False, "checkpoint_format": "gptq" if v1 else "gptq_v2"}
    if method == "awq":
        quant = {"quant_method": "awq", "bits": 4, "group_size": group, "zero_point": True, "version": "gemm"}
    cfg["quantization_config"] = quant
    (packed_dir / "config.json").write_text(json.dumps(cfg))
    return packed_dir, float_dir


@pytest.mark.parametrize(
    ("method", "group", "v1", "act_order", "bits"),
    [
        ("gptq", 32, True, False, 4),
        ("gptq", 64, False, False, 4),
        ("gptq", -1, True, False, 4),
        ("gptq", 128, True, True, 4),
        ("awq", 32, False, False, 4),
        ("awq", 256, False, False, 4),
        ("gptq", 32, True, False, 8),
        ("gptq", 128, False, True, 8),
        ("gptq", -1, False, False, 8),
    ],
)
def test_packed_tensors_read_back_as_their_weights(
    method: str, group: int, v1: bool, act_order: bool, bits: int
) -> None:
    rng = np.random.default_rng(1)
    w = torch.randn(48, 512)
    order = rng.permutation(512) if act_order else None
    linear = quantize(w, 512 if group == -1 else group, rng, v1, order, bits)
    spec = QuantizedCheckpoint(method, group, zeros_minus_one=v1, bits=bits)
    blocks = blocks_of(linear.tensors(method, v1), spec, "test")
    assert blocks.q.dtype == (torch.uint8 if bits == 4 else torch.int8)
    assert torch.equal(blocks.dequantized(), linear.weight())
    assert blocks.group == (128 if group in (-1, 256) else group)  # the kernel's largest that divides
    assert (blocks.order is not None) == act_order


@pytest.mark.parametrize(
    ("method", "rank", "act_order"), [("gptq", 0, None), ("awq", 1, None), ("gptq", 1, "shared")]
)
def test_each_rank_places_the_packed_weights_as_the_float_ones(
    checkpoints, tmp_path, method: str, rank: int, act_order: str | None
) -> None:
    packed, floats = write_packed(checkpoints["qwen2"], tmp_path, method, 32, act_order=act_order)
    cfg, shard = ModelConfig.from_dir(packed), TpShard(rank, 2)
    tp = TensorParallel(shard)
    model = load_model(packed, cfg, torch.float32, torch.device("cpu"), 64, tp)
    # Under act-order a rank's share of O's and down's scattered groups is dequantized.
    row_parallel = ("o_proj", "mlp.down_proj")
    built = load_packed_linears(model, shard_files(packed), cfg, shard, keep=True)
    assert built == ((4, 4) if act_order else (8, 0))
    reference = load_model(floats, ModelConfig.from_dir(floats), torch.float32, torch.device("cpu"), 64, tp)
    for name in [
        f"layers.{i}.{m}" for i in range(2) for m in ("qkv_proj", "mlp.gate_up_proj", *row_parallel)
    ]:
        linear, want = model.get_submodule(name), reference.get_submodule(name)
        kept = not (act_order and name.endswith(row_parallel))
        assert isinstance(linear, Int4Linear) == kept, name
        got = linear(torch.eye(linear.in_features)) - (0 if want.bias is None else want.bias)
        torch.testing.assert_close(got.t(), want.weight, rtol=1e-6, atol=1e-6, msg=name)


# Act-order with one column order per input (GPTQ's: from the input's statistics) keeps every
# linear; with one per linear, a fused linear's parts differ and it is dequantized instead.
KINDS = {"gptq": ("gptq", None, 8), "awq": ("awq", None, 8), "act-order": ("gptq", "shared", 8)}
KINDS["act-order-own"] = ("gptq", "own", 4)


@pytest.mark.parametrize("offload", list(MODES))
@pytest.mark.parametrize("kind", list(KINDS))
def test_engine_generates_like_the_float_checkpoint_of_its_weights(
    checkpoints, tmp_path, kind: str, offload: str
) -> None:
    method, act_order, kept = KINDS[kind]
    packed, floats = write_packed(checkpoints["qwen2"], tmp_path, method, 32, act_order=act_order)
    want, _ = tokens_and_count(floats, Int4Linear, offload)
    # Inferred from quantization_config (2 layers of 4 linears), then dequantized at load.
    assert tokens_and_count(packed, Int4Linear, offload) == (want, kept)
    assert tokens_and_count(packed, Int4Linear, offload, quantization="none") == (want, 0)


kernel = pytest.mark.skipif(
    not quant_kernel_applies(torch.device("cpu"), torch.bfloat16), reason="no AVX512_BF16"
)


@kernel
@pytest.mark.parametrize(("rank", "size"), [(0, 1), (1, 2)])
def test_8_bit_gptq_is_kept_as_grouped_int8_placed_as_the_float_weights(
    checkpoints, tmp_path, rank: int, size: int
) -> None:
    """In bf16 where our kernel runs, act-order included (the input gathered first); weights
    exact in bf16, so the kernel multiplies by exactly the float checkpoint's."""
    packed, floats = write_packed(checkpoints["qwen2"], tmp_path, "gptq", 32, False, "shared", 8, True)
    cfg, shard = ModelConfig.from_dir(packed), TpShard(rank, size)
    tp = SINGLE_PROCESS if size == 1 else TensorParallel(shard)
    model = load_model(packed, cfg, torch.bfloat16, torch.device("cpu"), 64, tp)
    # Under act-order a rank's share of O's and down's scattered groups is dequantized.
    row_parallel = ("o_proj", "mlp.down_proj") if size > 1 else ()
    built = load_packed_linears(model, shard_files(packed), cfg, shard, keep=True)
    assert built == ((4, 4) if row_parallel else (8, 0))
    reference = load_model(floats, ModelConfig.from_dir(floats), torch.bfloat16, torch.device("cpu"), 64, tp)
    for name in [
        f"layers.{i}.{m}"
        for i in range(2)
        for m in ("qkv_proj", "o_proj", "mlp.gate_up_proj", "mlp.down_proj")
    ]:
        linear, want = model.get_submodule(name), reference.get_submodule(name)
        kept = not (row_parallel and name.endswith(row_parallel))
        assert isinstance(linear, GroupedInt8Linear) == kept, name
        eye = torch.eye(linear.in_features, dtype=torch.bfloat16)
        got = linear(eye).float() - (0 if want.bias is None else want.bias.float())
        # Exact but for the bias, added in f32 before the output's rounding to bf16.
        w = want.weight.float()
        bound = 0 if want.bias is None else (w.abs() + want.bias.float().abs()[:, None]) * 2**-8
        assert ((got.t() - w).abs() <= bound).all(), name


@pytest.mark.parametrize("offload", list(MODES))
@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_8_bit_gptq_generates_like_the_float_checkpoint(
    checkpoints, tmp_path, offload: str, dtype: str
) -> None:
    """Kept as grouped int8 where our kernel runs it (a CPU with AVX512_BF16, in either dtype);
    dequantized at load elsewhere (float32 with AVX2 alone). Weights exact in bf16: the kernel and
    oneDNN multiply by the same values."""
    runs = grouped_int8_runs(torch.device("cpu"), getattr(torch, dtype))
    if dtype == "bfloat16" and not runs:
        pytest.skip("no AVX512_BF16")
    packed, floats = write_packed(checkpoints["qwen2"], tmp_path, "gptq", 32, True, "shared", 8, True)
    want, _ = tokens_and_count(floats, GroupedInt8Linear, offload, dtype)
    kept = 8 if runs else 0
    assert tokens_and_count(packed, GroupedInt8Linear, offload, dtype) == (want, kept)
    assert len({t for seq in want for t in seq}) > 3


def test_what_we_cannot_load_is_named(checkpoints, tmp_path) -> None:
    packed, _ = write_packed(checkpoints["llama"], tmp_path, "gptq", 32)
    base = json.loads((packed / "config.json").read_text())
    for field, value, match in [
        ("bits", 3, "bits 3: GPTQ loads 4 or 8 bits"),
        ("group_size", 48, "group_size 48: takes multiples of 32"),
        ("checkpoint_format", "marlin", "checkpoint_format 'marlin'"),
    ]:
        cfg = {**base, "quantization_config": {**base["quantization_config"], field: value}}
        (packed / "config.json").write_text(json.dumps(cfg))
        with pytest.raises(ModelLoadError, match=match):
            LLM(str(packed), num_gpu_blocks=8)
    (packed / "config.json").write_text(json.dumps(base))
    with pytest.raises(InvalidArgumentError, match="the checkpoint is gptq-quantized"):
        LLM(str(packed), quantization="int8")
    awq = {**base, "quantization_config": {"quant_method": "awq", "bits": 8, "group_size": 32}}
    (packed / "config.json").write_text(json.dumps(awq))
    with pytest.raises(ModelLoadError, match="bits 8: AWQ loads 4 bits only"):
        LLM(str(packed), num_gpu_blocks=8)
    (packed / "config.json").write_text(json.dumps(base))
    with pytest.raises(InvalidArgumentError, match="quantization 'awq' needs an AWQ checkpoint"):
        LLM(str(packed), quantization="awq")
    with pytest.raises(InvalidArgumentError, match="quantization 'gptq' needs a GPTQ checkpoint"):
        LLM(str(checkpoints["llama"]), quantization="gptq")
    # A fused linear with a part neither packed nor float: no rows left unwritten.
    tensors = load_file(packed / "model.safetensors")
    v_proj = [n for n in tensors if n.startswith("model.layers.1.self_attn.v_proj.")]
    save_file({n: t for n, t in tensors.items() if n not in v_proj}, packed / "model.safetensors")
    with pytest.raises(ModelLoadError, match=r"layers.1.qkv_proj: the checkpoint's parts of it fill \d+ of"):
        LLM(str(packed), num_gpu_blocks=8)
