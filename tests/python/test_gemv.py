"""The Rust bf16 linear for a few rows (``_core.Bf16Linear``) and its place in ``PackedLinear``:
the same sums as ``F.linear`` up to one rounding, the same bits on any number of threads, typed
errors for what it cannot take, and the engine's single streams running it (a tied LM head
included, without copying the embedding)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from neo_rs import LLM, SamplingParams
from neo_rs._core import Bf16Linear
from neo_rs.errors import BackendError, DTypeError, InvalidArgumentError, ShapeError
from neo_rs.model import rust_linears
from neo_rs.model.graph_ops import bound_linears, number_linears
from neo_rs.model.packed import GEMV_ROWS, PackedLinear, gemv_rows, pack_linears, packing_applies
from neo_rs.model.rust_linears import gemv_applies
from torch import nn


def _runs(path: str) -> bool:
    try:
        Bf16Linear(torch.zeros(1, 1, dtype=torch.bfloat16), num_threads=1, path=path)
    except BackendError:  # not on this CPU
        return False
    return True


# Every path of the kernel this CPU runs (AVX2 too where AVX-512 is the engine's).
PATHS = [p for p in ("scalar", "avx2", "avx512_bf16", "neon", "neon_bf16") if _runs(p)]


def _close_to_f32(out: torch.Tensor, x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None) -> None:
    """``out`` is the float32 result rounded once to bf16: within a bf16 step (8 significant bits)
    of it, plus what summing ``k`` products in another order can move an f32 sum (``k`` roundings
    of at most 2^-24 of the products' magnitudes)."""
    ref = F.linear(x.float(), w.float(), None if b is None else b.float())
    magnitude = F.linear(x.float().abs(), w.float().abs(), None if b is None else b.float().abs())
    bound = ref.abs() * 2**-7 + magnitude * x.shape[-1] * 2**-24
    assert ((out.float() - ref).abs() <= bound).all(), ((out.float() - ref).abs() - bound).max()


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("bias", [False, True])
def test_matches_the_float32_linear(path: str, bias: bool) -> None:
    torch.manual_seed(0)
    w = torch.randn(83, 200, dtype=torch.bfloat16)
    b = torch.randn(83, dtype=torch.bfloat16) if bias else None
    lin = Bf16Linear(w, b, num_threads=2, path=path)
    assert lin.path == path
    for rows in (1, 2, 5, 9):
        x = torch.randn(rows, 200, dtype=torch.bfloat16)
        out = torch.full((rows, 83), float("nan"), dtype=torch.bfloat16)
        lin.forward(x, out)
        _close_to_f32(out, x, w, b)


def test_threads_split_the_rows_without_changing_a_bit() -> None:
    torch.manual_seed(1)
    w = torch.randn(1000, 96, dtype=torch.bfloat16)  # 63 work items of 16 rows, the last short
    x = torch.randn(2, 96, dtype=torch.bfloat16)
    outs = []
    for threads in (1, 2, 3):
        out = torch.empty(2, 1000, dtype=torch.bfloat16)
        Bf16Linear(w, num_threads=threads).forward(x, out)
        outs.append(out)
    assert torch.equal(outs[0], outs[1]) and torch.equal(outs[0], outs[2])


def test_refuses_what_it_cannot_take() -> None:
    w = torch.randn(8, 16, dtype=torch.bfloat16)
    lin = Bf16Linear(w, num_threads=1)
    x, out = torch.randn(2, 16, dtype=torch.bfloat16), torch.empty(2, 8, dtype=torch.bfloat16)
    with pytest.raises(DTypeError):
        Bf16Linear(w.float(), num_threads=1)
    with pytest.raises(ShapeError):
        Bf16Linear(w, torch.zeros(7, dtype=torch.bfloat16), num_threads=1)
    with pytest.raises(DTypeError):
        lin.forward(x.float(), out)
    with pytest.raises(ShapeError):
        lin.forward(torch.randn(2, 15, dtype=torch.bfloat16), out)
    with pytest.raises(ShapeError):
        lin.forward(x, torch.empty(3, 8, dtype=torch.bfloat16))
    with pytest.raises(InvalidArgumentError, match="contiguous"):
        lin.forward(torch.randn(16, 2, dtype=torch.bfloat16).t(), out)
    with pytest.raises(TypeError, match="x must be a torch.Tensor, got list"):
        lin.forward([[0.0] * 16], out)
    with pytest.raises(DTypeError, match="unsupported dtype torch.float64"):
        lin.forward(x.double(), out)
    with pytest.raises(InvalidArgumentError, match="must be a CPU tensor, got device meta"):
        lin.forward(x.to("meta"), out)
    with pytest.raises(InvalidArgumentError, match="unknown linear kernel"):
        Bf16Linear(w, num_threads=1, path="avx3")
    lin.forward(x, out)  # and it still works


needs_gemv = pytest.mark.skipif(
    not (gemv_applies() and packing_applies(torch.device("cpu"), torch.bfloat16)),
    reason="the Rust linear runs only where the CPU has AVX512_BF16",
)


@needs_gemv
@pytest.mark.parametrize(("width", "most"), [(64, GEMV_ROWS), (2048, 4), (3000, 2), (8192, 1), (14336, 1)])
def test_packed_linear_runs_it_for_a_few_rows_only(width: int, most: int) -> None:
    """Up to 8 rows, fewer as the rows' inputs outgrow 16 KiB, and one row at any width."""
    assert gemv_rows(width) == most
    torch.manual_seed(2)
    lin = nn.Linear(width, 48, bias=True).to(torch.bfloat16)
    packed = PackedLinear(lin, rows=64, gemv_threads=2)
    calls = []
    real = packed.gemv
    packed.gemv = type(
        "Spy", (), {"forward": lambda _, x, out: (calls.append(len(x)), real.forward(x, out))}
    )()
    for rows in (1, most, most + 1, 64):
        x = torch.randn(rows, width, dtype=torch.bfloat16)
        _close_to_f32(packed(x), x, lin.weight, lin.bias)
    assert calls == [1, most]  # the rest ran oneDNN
    three_d = torch.randn(1, 1, width, dtype=torch.bfloat16)
    assert packed(three_d).shape == (1, 1, 48)


@needs_gemv
def test_a_tied_head_runs_it_on_the_embedding_itself() -> None:
    model = nn.Sequential(nn.Embedding(50, 16), nn.Linear(16, 50, bias=False)).to(torch.bfloat16)
    model[1].weight = model[0].weight
    pack_linears(model, rows=8, gemv_threads=1)
    head = model[1]
    assert isinstance(head, PackedLinear) and head.gemv is not None
    assert head.weight is model[0].weight  # the kernel's weight is not a copy
    x = torch.randn(1, 16, dtype=torch.bfloat16)
    _close_to_f32(head(x), x, model[0].weight, None)


@pytest.mark.parametrize(
    ("path", "by_default", "when_asked"),
    [
        ("avx512_bf16", True, True),
        ("avx2", True, True),
        ("neon_bf16", False, True),
        ("neon", False, True),
        ("scalar", False, False),
    ],
)
def test_the_engine_takes_timed_paths_and_others_when_asked(
    monkeypatch: pytest.MonkeyPatch, path: str, by_default: bool, when_asked: bool
) -> None:
    """NEON's paths (tested under qemu-user, not timed on an Arm CPU) run only with
    ``NEO_RS_ROW_GEMV=1``; the scalar reference never; ``0`` turns every path off."""
    monkeypatch.setattr(rust_linears, "gemv_path", lambda: path)
    monkeypatch.delenv("NEO_RS_ROW_GEMV", raising=False)
    assert gemv_applies() == by_default
    monkeypatch.setenv("NEO_RS_ROW_GEMV", "1")
    assert gemv_applies() == when_asked
    monkeypatch.setenv("NEO_RS_ROW_GEMV", "0")
    assert not gemv_applies()


@needs_gemv
def test_single_streams_run_it_in_the_engine(monkeypatch: pytest.MonkeyPatch) -> None:
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    runs = {}
    for flag in ("0", "1"):
        monkeypatch.setenv("NEO_RS_ROW_GEMV", flag)
        with LLM(dtype="bfloat16") as llm:
            model = llm.engine.runner.model
            for linear in (model.decoder_layers[0].qkv_proj, model.lm_head):
                assert (linear.gemv is not None) == (flag == "1")
            runs[flag] = llm.generate(["one stream"], params, use_tqdm=False)[0].outputs[0].token_ids
    # The demo model's logits are far apart: a bf16 rounding here and there changes no token.
    assert runs["0"] == runs["1"]


@needs_gemv
def test_the_compiled_stack_runs_it(monkeypatch: pytest.MonkeyPatch) -> None:
    """bf16 on the CPU: the graph's ``neo_rs::packed_linear`` nodes reach the Rust kernel for a
    single stream, and the tokens are eager's."""
    calls = []
    real = PackedLinear.rows_kernel
    monkeypatch.setattr(PackedLinear, "rows_kernel", lambda self, x: (calls.append(1), real(self, x))[1])
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    tokens = {}
    for eager in (True, False):
        with LLM(dtype="bfloat16", enforce_eager=eager) as llm:
            compiled = llm.engine.runner.compiled
            assert (compiled is None) == eager
            calls.clear()
            tokens[eager] = llm.generate(["one stream"], params, use_tqdm=False)[0].outputs[0].token_ids
            assert calls, "single-row linears ran the Rust kernel"
            if compiled is not None:
                assert compiled.runs == 12 and compiled.graphs == 2
    assert tokens[True] == tokens[False]


@needs_gemv
@pytest.mark.parametrize("rows", [1, GEMV_ROWS + 1])
def test_the_graph_op_keeps_its_fake_shapes(rows: int) -> None:
    """Inductor's run-time checks of op outputs are off (``worker/compiled.py``): opcheck holds
    ``neo_rs::packed_linear``'s fake implementation to the real one instead."""
    lin = nn.Linear(64, 48, bias=False).to(torch.bfloat16)
    table = number_linears(nn.Sequential(PackedLinear(lin, rows=8, gemv_threads=2)))
    with bound_linears(table):
        x = torch.randn(rows, 64, dtype=torch.bfloat16)
        torch.library.opcheck(torch.ops.neo_rs.packed_linear.default, (x, 0, 48))
