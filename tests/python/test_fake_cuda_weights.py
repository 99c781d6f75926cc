"""Quantized weights on the engine's CUDA path, run without a GPU (``fake_cuda.py``, helpers from
``test_fake_cuda.py``): int8, int4 and FP8 quantized at load; GPTQ, FP8 and GGUF checkpoints kept
as they come, each on the kernel its GPU and dtype take (torch's, or our Triton GEMM over int4 and
grouped int8); the bytes they save going to the KV pool, and never a float copy of the kept linears
on the device."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from fake_cuda import GIB, FakeCuda
from neo_rs import LLMEngine
from neo_rs.cuda_runtime import runtime
from neo_rs.model.fp8 import Fp8Linear
from neo_rs.model.quant import GroupedInt8Linear, GroupedLinear, Int4Linear, decoder_linears
from neo_rs.worker import runner as runner_module
from test_fake_cuda import engine_on, fake_gpu, queue, run
from test_fp8_checkpoint import write_fp8
from test_gguf import write_gguf
from test_gptq_awq import write_packed
from torch import nn


@pytest.mark.parametrize(
    ("method", "kernel", "capability"),
    [
        ("int8", "aten._weight_int8pack_mm.default", (9, 0)),
        ("int4", "aten._weight_int4pack_mm.default", (9, 0)),
        ("fp8", "aten._scaled_mm.default", (8, 9)),
        ("fp8", "neo_rs.fp8_gemm.default", (8, 0)),  # before Ada: weight-only, our Triton GEMM
    ],
)
def test_quantized_weights(monkeypatch, checkpoints, method: str, kernel: str, capability) -> None:
    """--quantization int8|int4|fp8 on CUDA: the weights quantized on the device at load, the
    GPU's kernel in every linear, within the budget (Qwen3's widths are int4's: the demo model's FFN
    of 688 columns is no multiple of its groups)."""
    with fake_gpu(monkeypatch, capability=capability) as checks:
        engine = engine_on(
            str(checkpoints["qwen3"]),
            offload="neo",
            num_gpu_blocks=10,
            neo_force_pipeline=True,
            quantization=method,
        )
        # The float weights' memory went back to the driver before the pools were sized (a GPU's
        # free memory would not show it while torch's cache held it).
        assert checks.runtime.cache_empties == 1
        queue(engine)
        assert "pipelined" in run(engine, checks)
        assert checks.ops[kernel], checks.ops
        assert method != "fp8" or ("_scaled_mm" in kernel) == bool(checks.ops["aten._scaled_mm.default"])
        engine.shutdown()


@pytest.fixture
def untraced_plan(monkeypatch: pytest.MonkeyPatch) -> None:
    """The activation trace allocates nothing on a real GPU: left out of the fake one's memory."""
    traced = runner_module.plan_activations

    def untracked(*args: Any, **kwargs: Any) -> Any:
        rt = runtime()
        assert isinstance(rt, FakeCuda)
        rt.track_memory = False
        try:
            return traced(*args, **kwargs)
        finally:
            rt.track_memory = True

    monkeypatch.setattr(runner_module, "plan_activations", untracked)


def _weight_bytes(engine: LLMEngine) -> int:
    model = engine.runner.model
    tensors = {t.untyped_storage(): t for t in [*model.parameters(), *model.buffers()]}.values()
    return sum(t.untyped_storage().nbytes() for t in tensors)


def test_quantized_weights_leave_the_bytes_they_save_to_the_kv_pool(
    monkeypatch, checkpoints, untraced_plan
) -> None:
    """The device pool is sized from the free memory after loading (torch's cache emptied): int4
    weights give it what they save over bf16, to within a block."""
    blocks, weights = {}, {}
    for method in ("none", "int4"):
        with fake_gpu(monkeypatch, total_bytes=GIB, track_memory=True):
            engine = engine_on(str(checkpoints["qwen3"]), quantization=method, gpu_memory_utilization=0.5)
            per_block = engine.runner.layout.bytes_per_block()
            weights[method], blocks[method] = _weight_bytes(engine), engine.runner.num_gpu_blocks
            engine.shutdown()
    saved = weights["none"] - weights["int4"]
    assert saved > 4 * per_block, (saved, per_block)
    assert abs((blocks["int4"] - blocks["none"]) * per_block - saved) < per_block, (blocks, saved, per_block)


# (method, bits, share): each load's kept linears save more than ``share`` of their bf16 bytes. 4
# bits with a 16-bit scale and zero per 32 save 0.625 of 16; FP8 with a scale per row, nearly 0.5;
# 8 bits with a scale and zero per 16 (a GGUF's K-quants), 0.375.
KEPT_LOADS = [
    ("gptq", 4, 1 / 2),
    ("gptq", 8, 1 / 3),
    ("fp8", 8, 1 / 2),
    ("fp8_block", 8, 1 / 2),
    ("gguf", 4, 1 / 2),
    ("gguf", 8, 1 / 3),
    ("int4", 4, 1 / 2),
]


@pytest.mark.parametrize(("method", "bits", "share"), KEPT_LOADS)
def test_quantized_weights_never_exist_as_floats_on_the_device(
    monkeypatch, checkpoints, tmp_path: Path, untraced_plan, method: str, bits: int, share: float
) -> None:
    """Loading a GPTQ or FP8 checkpoint, keeping a GGUF's blocks (4-bit, or grouped int8), or
    quantizing to int4 at load peaks below loading the same weights as floats by more than the
    share of their linears' bf16 bytes their kept form saves (``KEPT_LOADS``): the linears kept
    quantized never exist as floats on the device (int4 at load: each linear's float weight is
    assembled on the host)."""
    # (checkpoint, --quantization) of the quantized load and of its float twin.
    if method == "gptq":
        packed, floats = write_packed(checkpoints["qwen2"], tmp_path, "gptq", 32, bits=bits)
        loads = {"quantized": (packed, {}), "floats": (floats, {})}
    elif method.startswith("fp8"):
        strategy = "block" if method == "fp8_block" else "channel"
        fp8, floats = write_fp8(checkpoints["qwen2"], tmp_path, "compressed-tensors", strategy)
        loads = {"quantized": (fp8, {}), "floats": (floats, {})}
    else:
        gguf = method == "gguf"
        types = GGUF_TYPES[bits]
        checkpoint = write_gguf(tmp_path / "q.gguf", types=types) if gguf else checkpoints["qwen3"]
        at_load = {} if gguf else {"quantization": "int4"}  # a GGUF's blocks: inferred
        loads = {"quantized": (checkpoint, at_load), "floats": (checkpoint, {"quantization": "none"})}
    peaks = {}
    for kind, (path, asked) in loads.items():
        with fake_gpu(monkeypatch, track_memory=True) as checks:
            engine = engine_on(str(path), num_gpu_blocks=8, **asked)
            if kind == "floats":
                model = engine.runner.model
                linears = sum(model.get_submodule(n).weight.nbytes for n, *_ in decoder_linears(model))
            peaks[kind] = checks.runtime.peak_bytes
            engine.shutdown()
    assert peaks["quantized"] + linears * share < peaks["floats"], (peaks, linears)


# Where tinygemm runs (sm_80 on, bf16), its kernel; on a T4 in fp16, and in fp16 anywhere, ours.
INT4_KERNELS = [
    ((9, 0), "bfloat16", "aten._weight_int4pack_mm.default"),
    ((7, 5), "float16", "neo_rs.grouped_gemm.default"),
    ((8, 0), "float16", "neo_rs.grouped_gemm.default"),
]
# Grouped int8 has only our Triton GEMM on CUDA: every GPU and dtype.
INT8_KERNELS = [
    ((9, 0), "bfloat16", "neo_rs.grouped_gemm.default"),
    ((7, 5), "float16", "neo_rs.grouped_gemm.default"),
    ((8, 0), "float32", "neo_rs.grouped_gemm.default"),
]
# A GGUF's block types kept as int4, and as grouped int8 (groups of 32 and 16).
GGUF_TYPES = {4: ["Q4_0", "Q4_1", "Q4_K"], 8: ["Q8_0", "Q5_0", "Q5_1", "Q5_K", "Q6_K"]}


def _kept_on(
    monkeypatch: pytest.MonkeyPatch,
    model: str,
    capability,
    dtype: str,
    op: str,
    kind: type[GroupedLinear] = Int4Linear,
    **kw: Any,
) -> None:
    with fake_gpu(monkeypatch, capability=capability) as checks:
        engine = engine_on(
            model, dtype=dtype, offload="neo", num_gpu_blocks=10, neo_force_pipeline=True, **kw
        )
        modules = [m for layer in engine.runner.model.decoder_layers for m in layer.modules()]
        kept = [m for m in modules if isinstance(m, GroupedLinear)]
        assert kept and all(isinstance(m, kind) for m in kept), kept
        assert not any(isinstance(m, nn.Linear) for m in modules), "every decoder linear kept"
        queue(engine)
        assert "pipelined" in run(engine, checks)
        assert checks.ops[op], checks.ops
        engine.shutdown()


@pytest.mark.parametrize(("capability", "dtype", "op"), INT4_KERNELS)
def test_int4_weights_on_every_gpu(monkeypatch, checkpoints, capability, dtype: str, op: str) -> None:
    _kept_on(monkeypatch, str(checkpoints["qwen3"]), capability, dtype, op, quantization="int4")


@pytest.mark.parametrize(("capability", "dtype", "op"), INT4_KERNELS)
def test_a_gguf_keeps_its_blocks_on_every_gpu(
    monkeypatch, tmp_path: Path, capability, dtype: str, op: str
) -> None:
    """A .gguf model's 4-bit blocks (--quantization gguf, inferred), kept as int4 everywhere."""
    path = write_gguf(tmp_path / "q4.gguf", types=GGUF_TYPES[4])
    _kept_on(monkeypatch, str(path), capability, dtype, op)


@pytest.mark.parametrize(("capability", "dtype", "op"), INT8_KERNELS)
def test_a_gguf_keeps_its_other_blocks_as_grouped_int8_on_every_gpu(
    monkeypatch, tmp_path: Path, capability, dtype: str, op: str
) -> None:
    """A .gguf model's 5-, 6- and 8-bit blocks, kept as grouped int8 everywhere (our Triton GEMM)."""
    path = write_gguf(tmp_path / "q8.gguf", types=GGUF_TYPES[8])
    _kept_on(monkeypatch, str(path), capability, dtype, op, GroupedInt8Linear)


@pytest.mark.parametrize(("capability", "dtype", "op"), INT4_KERNELS[:2])
def test_a_gptq_checkpoint_keeps_its_int4_on_every_gpu(
    monkeypatch, checkpoints, tmp_path: Path, capability, dtype: str, op: str
) -> None:
    path, _ = write_packed(checkpoints["qwen2"], tmp_path, "gptq", 32)
    _kept_on(monkeypatch, str(path), capability, dtype, op)


@pytest.mark.parametrize(("capability", "dtype", "op"), INT8_KERNELS[:2])
def test_an_8bit_gptq_checkpoint_keeps_its_int8_on_every_gpu(
    monkeypatch, checkpoints, tmp_path: Path, capability, dtype: str, op: str
) -> None:
    path, _ = write_packed(checkpoints["qwen2"], tmp_path, "gptq", 32, bits=8)
    _kept_on(monkeypatch, str(path), capability, dtype, op, GroupedInt8Linear)


@pytest.mark.parametrize(
    ("kind", "strategy", "capability", "dtype", "op"),
    [
        ("compressed-tensors", "channel", (8, 9), "bfloat16", "aten._scaled_mm.default"),
        ("compressed-tensors", "channel", (7, 5), "float16", "neo_rs.fp8_gemm.default"),
        # Block-wise scales: weight-only everywhere, Hopper too.
        ("fp8", "block", (9, 0), "bfloat16", "neo_rs.fp8_gemm.default"),
        ("compressed-tensors", "block", (8, 0), "float32", "neo_rs.fp8_gemm.default"),
    ],
)
def test_an_fp8_checkpoint_on_every_gpu(
    monkeypatch, checkpoints, tmp_path: Path, kind: str, strategy: str, capability, dtype: str, op: str
) -> None:
    """An FP8 checkpoint multiplies in FP8 from sm_89 with a scale per row, else by our
    weight-only GEMM: every linear kept, no other kernel."""
    path, _ = write_fp8(checkpoints["qwen2"], tmp_path, kind, strategy)
    with fake_gpu(monkeypatch, capability=capability) as checks:
        engine = engine_on(str(path), dtype=dtype, offload="neo", num_gpu_blocks=10, neo_force_pipeline=True)
        modules = [m for layer in engine.runner.model.decoder_layers for m in layer.modules()]
        assert sum(isinstance(m, Fp8Linear) for m in modules) == 8  # 2 layers of 4
        assert not any(isinstance(m, nn.Linear) for m in modules)
        queue(engine)
        assert "pipelined" in run(engine, checks)
        others = {"aten._scaled_mm.default", "neo_rs.fp8_gemm.default"} - {op}
        assert checks.ops[op] and not any(checks.ops[o] for o in others), checks.ops
        engine.shutdown()
