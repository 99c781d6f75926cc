"""The Rust int8 linear (``_core.Int8Gemm``, ``quant.Int8CpuLinear``): the float32 sums of ``x``
by the int8 weight, scaled and rounded once, for any number of rows (the fused path up to 4, the
tiled path past it, tiles split evenly); the same bits on any number of threads; typed errors;
and the engine's int8 linears running it, eager and compiled."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from neo_rs import LLM, SamplingParams
from neo_rs._core import Int8Gemm
from neo_rs.errors import DTypeError, ShapeError
from neo_rs.model.graph_ops import bound_linears, number_linears
from neo_rs.model.packed import gemv_applies, packing_applies
from neo_rs.model.quant import Int8CpuLinear, Int8Linear, pack_int8
from torch import nn

PATHS = ["scalar"] + (["avx512_bf16"] if gemv_applies() else [])


def _int8(n: int, k: int, bias: bool, seed: int) -> Int8Linear:
    torch.manual_seed(seed)
    return Int8Linear(nn.Linear(k, n, bias=bias).to(torch.bfloat16))


def _close(out: torch.Tensor, x: torch.Tensor, lin: Int8Linear) -> None:
    """``out`` is ``(x @ q.T) * scale + bias`` in float32 rounded once to bf16: within a bf16
    step of it, plus what summing ``k`` products in another order can move an f32 sum."""
    q, scale = lin.weight.float(), lin.scales.float()
    bias = 0 if lin.bias is None else lin.bias.float()
    ref = F.linear(x.float(), q) * scale + bias
    magnitude = F.linear(x.float().abs(), q.abs()) * scale
    bound = ref.abs() * 2**-7 + magnitude * (x.shape[-1] + 2) * 2**-24
    assert ((out.float() - ref).abs() <= bound).all(), ((out.float() - ref).abs() - bound).max()


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("bias", [False, True])
def test_the_kernel_sums_by_the_int8_weight(path: str, bias: bool) -> None:
    lin = _int8(83, 201, bias, seed=0)  # a partial block of columns, an odd input width
    gemm = Int8Gemm(
        pack_int8(lin.weight), lin.scales.float(), lin.bias, n=83, k=201, num_threads=2, path=path
    )
    assert gemm.path == path
    for rows in (1, 2, 4, 5, 13, 16, 40):  # fused; tiled: one tile, two even ones, several
        x = torch.randn(rows, 201, dtype=torch.bfloat16)
        out = torch.full((rows, 83), float("nan"), dtype=torch.bfloat16)
        gemm.forward(x, out)
        _close(out, x, lin)


@pytest.mark.parametrize("rows", [1, 24])
def test_threads_split_the_blocks_without_changing_a_bit(rows: int) -> None:
    lin = _int8(1000, 96, False, seed=1)  # 63 blocks of 16 columns, the last short
    x = torch.randn(rows, 96, dtype=torch.bfloat16)
    outs = []
    for threads in (1, 2, 3):
        out = torch.empty(rows, 1000, dtype=torch.bfloat16)
        Int8Gemm(pack_int8(lin.weight), lin.scales.float(), n=1000, k=96, num_threads=threads).forward(x, out)
        outs.append(out)
    assert torch.equal(outs[0], outs[1]) and torch.equal(outs[0], outs[2])


def test_refuses_what_it_cannot_take() -> None:
    lin = _int8(8, 16, False, seed=2)
    packed, scales = pack_int8(lin.weight), lin.scales.float()
    gemm = Int8Gemm(packed, scales, n=8, k=16, num_threads=1)
    x, out = torch.randn(2, 16, dtype=torch.bfloat16), torch.empty(2, 8, dtype=torch.bfloat16)
    with pytest.raises(DTypeError, match="packed must be int8"):
        Int8Gemm(packed.float(), scales, n=8, k=16, num_threads=1)
    with pytest.raises(ShapeError, match="packed must have shape"):
        Int8Gemm(packed, scales, n=17, k=16, num_threads=1)
    with pytest.raises(DTypeError, match="scales must be float32"):
        Int8Gemm(packed, lin.scales, n=8, k=16, num_threads=1)
    with pytest.raises(ShapeError, match="bias must have shape"):
        Int8Gemm(packed, scales, torch.zeros(7, dtype=torch.bfloat16), n=8, k=16, num_threads=1)
    with pytest.raises(DTypeError):
        gemm.forward(x.float(), out)
    with pytest.raises(ShapeError):
        gemm.forward(torch.randn(2, 15, dtype=torch.bfloat16), out)
    with pytest.raises(ShapeError):
        gemm.forward(x, torch.empty(3, 8, dtype=torch.bfloat16))
    gemm.forward(x, out)  # and it still works


def test_the_packing_keeps_every_weight() -> None:
    lin = _int8(37, 9, True, seed=3)
    cpu = Int8CpuLinear(lin, threads=1)
    assert cpu.weight.shape == (3, 5, 16, 2) and cpu.weight.dtype == torch.int8
    assert torch.equal(cpu.dequantized(), lin.dequantized())
    for rows in (0, 1, 6):
        x = torch.randn(2, rows, 9, dtype=torch.bfloat16)
        out = cpu(x)
        assert out.shape == (2, rows, 37)
        if rows:
            _close(out.reshape(-1, 37), x.reshape(-1, 9), lin)


needs_kernel = pytest.mark.skipif(
    not (gemv_applies() and packing_applies(torch.device("cpu"), torch.bfloat16)),
    reason="the Rust linears run only where the CPU has AVX512_BF16",
)
PARAMS = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)


@needs_kernel
def test_the_engines_int8_linears_run_it(monkeypatch: pytest.MonkeyPatch) -> None:
    """bf16 on the CPU: each int8 decoder linear is an ``Int8CpuLinear`` (with the Rust linears
    off, torch's kernel), for one stream and a batch; the demo model's logits are far apart, so a
    bf16 rounding here and there changes no token."""
    runs = {}
    prompts = ["one stream", "a batch of", "three prompts"]
    for flag in ("0", "1"):
        monkeypatch.setenv("NEO_RS_ROW_GEMV", flag)
        with LLM(dtype="bfloat16", quantization="int8") as llm:
            qkv = llm.engine.runner.model.decoder_layers[0].qkv_proj
            assert type(qkv) is (Int8CpuLinear if flag == "1" else Int8Linear)
            outs = llm.generate(prompts, PARAMS, use_tqdm=False)
            runs[flag] = [o.outputs[0].token_ids for o in outs]
    assert runs["0"] == runs["1"]


@needs_kernel
def test_the_compiled_stack_runs_it(monkeypatch: pytest.MonkeyPatch) -> None:
    calls = []
    real = Int8CpuLinear.linear
    monkeypatch.setattr(Int8CpuLinear, "linear", lambda self, x: (calls.append(1), real(self, x))[1])
    tokens = {}
    for eager in (True, False):
        with LLM(dtype="bfloat16", quantization="int8", enforce_eager=eager) as llm:
            compiled = llm.engine.runner.compiled
            assert (compiled is None) == eager
            calls.clear()
            tokens[eager] = llm.generate(["one stream"], PARAMS, use_tqdm=False)[0].outputs[0].token_ids
            assert calls
            if compiled is not None:
                assert compiled.runs == 11 and compiled.graphs == 2
    assert tokens[True] == tokens[False]


@needs_kernel
@pytest.mark.parametrize("rows", [1, 7])
def test_the_graph_op_keeps_its_fake_shapes(rows: int) -> None:
    table = number_linears(nn.Sequential(Int8CpuLinear(_int8(48, 64, True, seed=4), threads=2)))
    with bound_linears(table):
        x = torch.randn(rows, 64, dtype=torch.bfloat16)
        torch.library.opcheck(torch.ops.neo_rs.packed_linear.default, (x, 0, 48))
