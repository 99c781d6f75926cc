"""Our Rust kernel for int8, int4 and grouped int8 weights (``_core.QuantGemm``, run by
``quant.Int8Linear``, ``quant.Int4Linear`` and ``quant.GroupedInt8Linear`` on a CPU with
AVX512_BF16 or AVX2, in bf16, float16 and float32; NEON's when asked): the
float32 sums of ``x`` by the weight (the scales and zeros applied to float32 sums), rounded once
to the model's dtype, for any number of rows (the fused path up to 4, the tiled path past it,
tiles split evenly); the same bits on any number of threads; typed errors; and the engine's
quantized linears running it, eager and compiled."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from neo_rs import LLM, InvalidArgumentError, SamplingParams
from neo_rs._core import QuantGemm
from neo_rs.errors import BackendError, DTypeError, ShapeError
from neo_rs.model import rust_linears
from neo_rs.model.graph_ops import bound_linears, number_linears
from neo_rs.model.packed import packing_applies
from neo_rs.model.quant import (
    Int4Linear,
    Int8Linear,
    grouped_int8_runs,
    pack_int4,
    pack_int8,
    quantize_int4,
    quantize_int8,
)
from neo_rs.model.rust_linears import gemv_applies, quant_kernel_applies
from torch import nn


def _runs(path: str) -> bool:
    try:
        scales = torch.ones(1, dtype=torch.bfloat16)
        QuantGemm.int8(torch.zeros(1, 1, 16, 2, dtype=torch.int8), scales, n=1, k=1, num_threads=1, path=path)
    except BackendError:  # not on this CPU
        return False
    return True


DTYPES = (torch.bfloat16, torch.float16, torch.float32)
# Every path of the kernel this CPU runs, in each dtype: AVX2's beside AVX-512's.
PATHS = [(p, d) for d in DTYPES for p in ("scalar", "avx2", "avx512_bf16", "neon", "neon_bf16") if _runs(p)]


def _linear(n: int, k: int, bias: bool, seed: int, dtype: torch.dtype = torch.bfloat16) -> nn.Linear:
    torch.manual_seed(seed)
    return nn.Linear(k, n, bias=bias).to(dtype)


# Each dtype's unit of rounding: half its relative step.
UNIT = {torch.bfloat16: 2**-8, torch.float16: 2**-11, torch.float32: 2**-24}


def _close(
    out: torch.Tensor, x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None, widened: bool
) -> None:
    """``out`` is ``x @ w.T + bias`` in float32 rounded once to its dtype: within a step of it,
    plus what summing ``k`` products in another order can move an f32 sum, plus (``widened``:
    the grouped formats, whose group sums are scaled and offset by each group's ``sum(x)`` in f32)
    a bound on that cancellation: in bf16 (AVX-512 offsets int4's by ``128 * sum(x)``) a bf16 step
    of each product; else 16 f32 units of each (the group's terms, its scale times ``sum(x * q)``
    and its offset times ``sum(x)``, are a few times its products, and each is rounded once)."""
    b = 0 if bias is None else bias.float()
    ref = F.linear(x.float(), w.float()) + b
    magnitude = F.linear(x.float().abs(), w.float().abs())
    cancelled = 2**-8 if out.dtype == torch.bfloat16 else 16 * 2**-24
    bound = ref.abs() * 2 * UNIT[out.dtype] + magnitude * (
        (x.shape[-1] + 2) * 2**-24 + (cancelled if widened else 0)
    )
    assert ((out.float() - ref).abs() <= bound).all(), ((out.float() - ref).abs() - bound).max()


def _int8(  # noqa: ANN202
    n: int, k: int, bias: bool, seed: int, path: str | None = None, threads: int = 2, dtype=torch.bfloat16
):
    lin = _linear(n, k, bias, seed, dtype)
    q, scale = quantize_int8(lin.weight)
    scales = scale.to(dtype)
    gemm = QuantGemm.int8(pack_int8(q), scales, lin.bias, n=n, k=k, num_threads=threads, path=path)
    return gemm, q.float() * scales.float()[:, None], lin.bias


def _grouped(  # noqa: ANN202
    n: int,
    k: int,
    group: int,
    bits: int,
    bias: bool,
    seed: int,
    path: str | None = None,
    threads: int = 2,
    dtype: torch.dtype = torch.bfloat16,
):
    """``bits`` 4: the linear quantized to int4; 8: any int8 values, a scale and an offset per group."""
    lin = _linear(n, k, bias, seed, dtype)
    if bits == 4:
        q, scale, zero = quantize_int4(lin.weight, group)
        packed, values = pack_int4(q), q.float() - 8
    else:
        g = torch.Generator().manual_seed(seed)
        q = torch.randint(-128, 128, (n, k), generator=g, dtype=torch.int8)
        scale, zero = (
            torch.rand(n, k // group, generator=g) * 1e-3,
            torch.randn(n, k // group, generator=g) * 1e-2,
        )
        packed, values = pack_int8(q), q.float()
    s, z = scale.to(dtype), zero.to(dtype)
    blocks = -(-n // 16)
    groups = torch.zeros(blocks * 16, k // group, 2, dtype=dtype)
    groups[:n, :, 0], groups[:n, :, 1] = s, z
    groups = groups.view(blocks, 16, k // group, 2).permute(0, 2, 3, 1).contiguous()
    gemm = QuantGemm.grouped(
        packed, groups, lin.bias, n=n, k=k, group=group, bits=bits, num_threads=threads, path=path
    )
    w = values.view(n, -1, group) * s.float()[..., None] + z.float()[..., None]
    return gemm, w.view(n, k), lin.bias


@pytest.mark.parametrize(("path", "dtype"), PATHS)
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("fmt", ["int8", "int4", "grouped int8"])
def test_the_kernel_sums_by_the_quantized_weight(path: str, dtype: torch.dtype, bias: bool, fmt: str) -> None:
    # A partial block of columns; int8 with an odd input width, int4 in groups of 32, grouped
    # int8 in 16s (Q6_K's).
    n, k = 83, (201 if fmt == "int8" else 192)
    if fmt == "int8":
        gemm, w, b = _int8(n, k, bias, 0, path, dtype=dtype)
    else:
        bits = 4 if fmt == "int4" else 8
        gemm, w, b = _grouped(n, k, 32 if fmt == "int4" else 16, bits, bias, 0, path, dtype=dtype)
    assert gemm.path == path
    for rows in (1, 2, 4, 5, 13, 16, 40):  # fused; tiled: one tile, two even ones, several
        x = torch.randn(rows, k, dtype=dtype)
        out = torch.full((rows, n), float("nan"), dtype=dtype)
        gemm.forward(x, out)
        _close(out, x, w, b, widened=fmt != "int8")


@pytest.mark.parametrize("rows", [1, 24])
@pytest.mark.parametrize("fmt", ["int8", "int4", "grouped int8"])
def test_threads_split_the_blocks_without_changing_a_bit(rows: int, fmt: str) -> None:
    x = torch.randn(rows, 96, dtype=torch.bfloat16)
    outs = []
    for threads in (1, 2, 3):  # 63 blocks of 16 columns, the last short
        if fmt == "int8":
            gemm = _int8(1000, 96, False, 1, threads=threads)[0]
        else:
            gemm = _grouped(1000, 96, 32, 4 if fmt == "int4" else 8, False, 1, threads=threads)[0]
        out = torch.empty(rows, 1000, dtype=torch.bfloat16)
        gemm.forward(x, out)
        outs.append(out)
    assert torch.equal(outs[0], outs[1]) and torch.equal(outs[0], outs[2])


def test_refuses_what_it_cannot_take() -> None:
    q, scale = quantize_int8(_linear(8, 16, False, 2).weight)
    packed, scales = pack_int8(q), scale.bfloat16()
    gemm = QuantGemm.int8(packed, scales, n=8, k=16, num_threads=1)
    x, out = torch.randn(2, 16, dtype=torch.bfloat16), torch.empty(2, 8, dtype=torch.bfloat16)
    with pytest.raises(DTypeError, match="packed must be Int8"):
        QuantGemm.int8(packed.float(), scales, n=8, k=16, num_threads=1)
    with pytest.raises(ShapeError, match="packed must have shape"):
        QuantGemm.int8(packed, scales, n=17, k=16, num_threads=1)
    with pytest.raises(DTypeError, match="scales must be a float tensor"):
        QuantGemm.int8(packed, scales.int(), n=8, k=16, num_threads=1)
    with pytest.raises(ShapeError, match="bias must have shape"):
        QuantGemm.int8(packed, scales, torch.zeros(7, dtype=torch.bfloat16), n=8, k=16, num_threads=1)
    with pytest.raises(DTypeError, match="bias must be bfloat16"):  # the scales' dtype, the model's
        QuantGemm.int8(packed, scales, torch.zeros(8), n=8, k=16, num_threads=1)
    groups = torch.zeros(1, 1, 2, 16, dtype=torch.bfloat16)
    packed4 = torch.zeros(1, 8, 16, dtype=torch.uint8)
    assert QuantGemm.grouped(packed4, groups, n=8, k=16, group=16, bits=4, num_threads=1).path
    with pytest.raises(ShapeError, match="group 5 must be even"):
        QuantGemm.grouped(packed4, groups, n=8, k=16, group=5, bits=4, num_threads=1)
    with pytest.raises(DTypeError, match="packed must be UInt8"):
        QuantGemm.grouped(packed4.view(torch.int8), groups, n=8, k=16, group=16, bits=4, num_threads=1)
    with pytest.raises(ShapeError, match="groups must have shape"):
        QuantGemm.grouped(packed4, groups, n=8, k=16, group=8, bits=4, num_threads=1)
    packed8 = torch.zeros(1, 8, 16, 2, dtype=torch.int8)
    assert QuantGemm.grouped(packed8, groups, n=8, k=16, group=16, bits=8, num_threads=1).path
    with pytest.raises(DTypeError, match="packed must be Int8"):
        QuantGemm.grouped(packed4, groups, n=8, k=16, group=16, bits=8, num_threads=1)
    with pytest.raises(InvalidArgumentError, match="bits must be 4 or 8, got 5"):
        QuantGemm.grouped(packed8, groups, n=8, k=16, group=16, bits=5, num_threads=1)
    with pytest.raises(DTypeError, match="x must be bfloat16"):
        gemm.forward(x.float(), out)
    with pytest.raises(DTypeError, match="out must be bfloat16"):
        gemm.forward(x, out.float())
    with pytest.raises(ShapeError):
        gemm.forward(torch.randn(2, 15, dtype=torch.bfloat16), out)
    with pytest.raises(ShapeError):
        gemm.forward(x, torch.empty(3, 8, dtype=torch.bfloat16))
    gemm.forward(x, out)  # and it still works


@pytest.mark.parametrize(
    ("path", "flag", "int8_int4", "grouped_int8"),
    [
        ("avx512_bf16", None, True, True),
        ("avx2", None, True, False),
        ("avx2", "0", False, False),
        ("scalar", None, False, False),
        ("scalar", "1", False, False),
        ("neon", None, False, False),
        ("neon_bf16", "1", True, False),
    ],
)
def test_which_formats_run_it_by_the_kernel_s_path(
    monkeypatch: pytest.MonkeyPatch, path: str, flag: str | None, int8_int4: bool, grouped_int8: bool
) -> None:
    """With AVX2 alone, int8 and int4 run our kernel (faster than torch's there) but grouped int8
    is dequantized at load (oneDNN's f32 GEMM on it was faster at batch sizes); the scalar
    reference never runs the engine's, NEON's (untimed) only when ``NEO_RS_ROW_GEMV=1`` asks, and
    ``NEO_RS_ROW_GEMV=0`` turns the kernel off. Float32 and float16 models take the same path as
    bf16 ones (torch's int8 and int4 kernels in those dtypes are many times slower)."""
    monkeypatch.setattr(rust_linears, "gemv_path", lambda: path)
    if flag is None:
        monkeypatch.delenv("NEO_RS_ROW_GEMV", raising=False)
    else:
        monkeypatch.setenv("NEO_RS_ROW_GEMV", flag)
    cpu = torch.device("cpu")
    for dtype in DTYPES:
        assert quant_kernel_applies(cpu, dtype) == int8_int4
        assert grouped_int8_runs(cpu, dtype) == grouped_int8
    assert not quant_kernel_applies(torch.device("cuda"), torch.float32)


needs_kernel = pytest.mark.skipif(
    not (gemv_applies() and packing_applies(torch.device("cpu"), torch.bfloat16)),
    reason="the Rust linears run only where the CPU has AVX512_BF16",
)


@needs_kernel
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_the_modules_pack_for_it_and_keep_every_weight(
    monkeypatch: pytest.MonkeyPatch, dtype: torch.dtype
) -> None:
    """A model in bf16 or float32 (where torch's int8 and int4 kernels are slow)
    packs its quantized linears for our kernel, with the rows torch's layout would hold; with the
    Rust linears off, torch's layout."""
    lin = _linear(37, 64, True, 3, dtype)
    int8 = Int8Linear(lin)
    monkeypatch.setenv("NEO_RS_ROW_GEMV", "0")
    torch8 = Int8Linear(lin)
    monkeypatch.delenv("NEO_RS_ROW_GEMV")
    assert int8.gemm is not None and torch8.gemm is None
    assert int8.weight.shape == (3, 32, 16, 2) and int8.weight.dtype == torch.int8
    # The same int8 rows, unpacked, and the same scales (in the model's dtype).
    assert torch.equal(int8.dequantized(), torch8.weight.to(dtype) * torch8.scales[:, None])
    lin4 = _linear(48, 64, True, 4, dtype)
    int4 = Int4Linear(lin4)
    assert int4.gemm is not None and int4.packed.shape == (3, 32, 16) and int4.packed.dtype == torch.uint8
    q = quantize_int4(lin4.weight, int4.group)[0]
    # int8's scales apply to the float32 sums: its weight is the rows times the scales in f32.
    w8 = torch8.weight.float() * int8.scales.float()[:, None]
    for module, w, b, widened in (
        (int8, w8, lin.bias, False),
        (int4, int4.dequantized(q), lin4.bias, True),
    ):
        for rows in (0, 1, 6):
            x = torch.randn(2, rows, 64, dtype=dtype)
            out = module(x)
            assert out.shape == (2, rows, module.out_features) and out.dtype == dtype
            if rows:
                _close(out.reshape(-1, module.out_features), x.reshape(-1, 64), w, b, widened)


PARAMS = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)


@needs_kernel
@pytest.mark.parametrize("method", ["int8", "int4"])
def test_the_engines_quantized_linears_run_it(
    monkeypatch: pytest.MonkeyPatch, checkpoints, method: str
) -> None:
    """bf16 on the CPU: each quantized decoder linear runs our kernel (with the Rust linears off,
    torch's), for one stream and a batch, with the same tokens: the demo model's logits are far
    apart (its widths are no int4 group's: int4 runs a tiny Llama 3), so a bf16 rounding here and
    there changes none."""
    model = None if method == "int8" else str(checkpoints["llama3"])
    runs = {}
    prompts = ["one stream", "a batch of", "three prompts"]
    for flag in ("0", "1"):
        monkeypatch.setenv("NEO_RS_ROW_GEMV", flag)
        with LLM(model, dtype="bfloat16", quantization=method, num_gpu_blocks=64) as llm:
            qkv = llm.engine.runner.model.decoder_layers[0].qkv_proj
            assert (qkv.gemm is not None) == (flag == "1")
            outs = llm.generate(prompts, PARAMS, use_tqdm=False)
            runs[flag] = [o.outputs[0].token_ids for o in outs]
    assert runs["0"] == runs["1"]


@needs_kernel
@pytest.mark.parametrize("kind", [Int8Linear, Int4Linear])
def test_the_compiled_stack_runs_it(monkeypatch: pytest.MonkeyPatch, checkpoints, kind: type) -> None:
    """The graph's ``neo_rs::packed_linear`` nodes reach our kernel, with eager's tokens."""
    calls = []
    real = kind.linear
    monkeypatch.setattr(kind, "linear", lambda self, x: (calls.append(1), real(self, x))[1])
    tokens = {}
    method = "int8" if kind is Int8Linear else "int4"
    model = None if method == "int8" else str(checkpoints["llama3"])  # as above
    for eager in (True, False):
        with LLM(model, dtype="bfloat16", quantization=method, enforce_eager=eager, num_gpu_blocks=64) as llm:
            compiled = llm.engine.runner.compiled
            assert (compiled is None) == eager
            calls.clear()
            tokens[eager] = llm.generate(["one stream"], PARAMS, use_tqdm=False)[0].outputs[0].token_ids
            assert calls
            if compiled is not None:
                assert compiled.runs == 12 and compiled.graphs == 2
    assert tokens[True] == tokens[False]


@needs_kernel
@pytest.mark.parametrize("rows", [1, 7])
def test_the_graph_op_keeps_its_fake_shapes(rows: int) -> None:
    lin = _linear(48, 64, True, 5)
    table = number_linears(nn.Sequential(Int8Linear(lin), Int4Linear(lin)))
    with bound_linears(table):
        x = torch.randn(rows, 64, dtype=torch.bfloat16)
        for slot in (0, 1):
            torch.library.opcheck(torch.ops.neo_rs.packed_linear.default, (x, slot, 48))
