"""Prepacked bf16 linears on the CPU (oneDNN): bit-identical to ``F.linear`` at any row count, in
place of every linear that owns its weight, and the same tokens end to end; computing in f32 on a
widened copy where that is faster (``gemm_compute``), within a bf16 rounding of the exact product,
also in the compiled stack."""

from __future__ import annotations

import neo_rs.model.packed as packed_module
import pytest
import torch
import torch.nn.functional as F
from neo_rs import LLM, SamplingParams
from neo_rs.errors import InvalidArgumentError
from neo_rs.model.packed import PackedLinear, gemm_compute, pack_linears, packing_applies
from neo_rs.worker.compiled import MAX_GRAPHS
from test_model_parity import PROMPTS
from torch import nn

pytestmark = pytest.mark.skipif(
    not packing_applies(torch.device("cpu"), torch.bfloat16), reason="this CPU has no native bf16 in oneDNN"
)


@pytest.mark.parametrize("bias", [False, True])
def test_packed_linear_matches_f_linear_bit_for_bit(bias: bool) -> None:
    torch.manual_seed(0)
    lin = nn.Linear(96, 200, bias=bias).to(torch.bfloat16)
    packed = PackedLinear(lin, rows=64)
    for rows in (1, 5, 64, 300):
        x = torch.randn(rows, 96, dtype=torch.bfloat16)
        assert torch.equal(packed(x), F.linear(x, lin.weight, lin.bias))


def test_pack_linears_packs_a_tied_head_too() -> None:
    model = nn.Sequential(nn.Embedding(50, 16), nn.Linear(16, 32), nn.Linear(16, 50, bias=False))
    model = model.to(torch.bfloat16)
    model[2].weight = model[0].weight  # tied, as an LM head
    assert pack_linears(model, rows=8)[0] == 2
    assert isinstance(model[1], PackedLinear) and isinstance(model[2], PackedLinear)
    x = torch.randn(9, 16, dtype=torch.bfloat16)
    assert torch.equal(model[2](x), F.linear(x, model[0].weight))


def test_same_tokens_with_and_without_packing(monkeypatch: pytest.MonkeyPatch) -> None:
    # oneDNN on its packed weight is bit for bit ``F.linear``; the Rust kernel that takes batches
    # of a few rows (and sums in another order) is left out, so that packing alone is compared.
    monkeypatch.setenv("NEO_RS_ROW_GEMV", "0")
    monkeypatch.setenv("NEO_RS_CPU_GEMM", "bfloat16")
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    prompts = ["packed weights", "the same tokens", "x"]
    runs = []
    for flag in ("0", "1"):
        monkeypatch.setenv("NEO_RS_PACK_LINEARS", flag)
        llm = LLM(dtype="bfloat16")
        layer = llm.engine.runner.model.decoder_layers[0]
        assert isinstance(layer.qkv_proj, PackedLinear) == (flag == "1")
        runs.append([o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)])
    assert runs[0] == runs[1]


def test_an_engine_of_one_sequence_never_packs_for_one_row(monkeypatch: pytest.MonkeyPatch) -> None:
    # oneDNN's layout for one row runs every other row count slower (prefill chunks, verifying
    # steps; ``benches/pack_rows.py``): weights are packed for two rows at least.
    hints: list[int] = []
    reorder = torch.ops.mkldnn._reorder_linear_weight
    monkeypatch.setattr(
        torch.ops.mkldnn, "_reorder_linear_weight", lambda w, rows: hints.append(rows) or reorder(w, rows)
    )
    with LLM("demo", dtype="bfloat16", max_num_seqs=1) as llm:
        assert isinstance(llm.engine.runner.model.lm_head, PackedLinear)
    assert hints and min(hints) >= 2, hints


@pytest.mark.parametrize("bias", [False, True])
def test_float32_compute_rounds_the_exact_product_once(bias: bool) -> None:
    torch.manual_seed(0)
    lin = nn.Linear(300, 200, bias=bias).to(torch.bfloat16)
    packed = PackedLinear(lin, rows=64, compute=torch.float32)
    assert packed.packed.dtype == torch.float32
    b = None if lin.bias is None else lin.bias.double()
    for rows in (1, 5, 64, 300):
        x = torch.randn(rows, 300, dtype=torch.bfloat16)
        out = packed(x)
        assert out.dtype == torch.bfloat16
        exact = F.linear(x.double(), lin.weight.double(), b)
        # One rounding to bf16 (half an ulp: at most 2**-8 relative) on top of f32 sums.
        torch.testing.assert_close(out.double(), exact, rtol=2**-8, atol=1e-5)


def test_gemm_compute_follows_the_environment_and_the_timing(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("NEO_RS_CPU_GEMM", "float32")
    assert gemm_compute(10**15) == torch.float32, "forced, whatever the memory"
    monkeypatch.setenv("NEO_RS_CPU_GEMM", "bfloat16")
    assert gemm_compute(1) == torch.bfloat16
    monkeypatch.setenv("NEO_RS_CPU_GEMM", "f32")
    with pytest.raises(InvalidArgumentError, match="NEO_RS_CPU_GEMM"):
        gemm_compute(1)
    monkeypatch.setenv("NEO_RS_CPU_GEMM", "auto")
    for speedup, want in ((1.5, torch.float32), (1.1, torch.bfloat16)):
        monkeypatch.setattr(packed_module, "float32_speedup", lambda threads, s=speedup: s)
        assert gemm_compute(1 << 20) == want
        assert gemm_compute(10**15) == torch.bfloat16, "f32 copies that do not fit stay bf16"


def test_without_a_bf16_gemm_of_onednn_s_own_batches_compute_in_f32(monkeypatch: pytest.MonkeyPatch) -> None:
    """A CPU without AVX512-BF16 (or Arm's BF16): f32 copies whenever they fit, else nothing
    packed (never bf16 packs), and no probe, whose bf16 GEMM would be the slow one; what the
    environment forces stays forced."""
    monkeypatch.setattr(packed_module, "bf16_native", lambda: False)
    monkeypatch.setattr(packed_module, "float32_speedup", lambda threads: pytest.fail("probed"))
    monkeypatch.setenv("NEO_RS_CPU_GEMM", "auto")
    assert gemm_compute(1 << 20) == torch.float32
    assert gemm_compute(10**15) is None
    monkeypatch.setenv("NEO_RS_CPU_GEMM", "bfloat16")
    assert gemm_compute(10**15) == torch.bfloat16, "forced"
    monkeypatch.setattr(packed_module, "gemm_compute", lambda weight_bytes: None)
    model = nn.Sequential(nn.Linear(8, 8)).to(torch.bfloat16)
    assert pack_linears(model, rows=4) == (0, torch.bfloat16)
    assert type(model[0]) is nn.Linear


def test_float32_compute_in_the_compiled_stack(checkpoints, monkeypatch: pytest.MonkeyPatch) -> None:
    # Graphs of two rows or more hand the op f32 rows (their casts fuse into the kernels beside);
    # the one-row graph keeps bf16 rows for the Rust kernel. No graph more than the two.
    monkeypatch.setenv("NEO_RS_CPU_GEMM", "float32")
    seen: set[tuple[bool, torch.dtype]] = set()
    linear = PackedLinear.linear

    def spy(self: PackedLinear, x: torch.Tensor) -> torch.Tensor:
        seen.add((x.numel() == self.in_features, x.dtype))
        return linear(self, x)

    monkeypatch.setattr(PackedLinear, "linear", spy)
    llm = LLM(str(checkpoints["llama"]), dtype="bfloat16", enforce_eager=False)
    compiled = llm.engine.runner.compiled
    head = llm.engine.runner.model.lm_head
    assert isinstance(head, PackedLinear) and head.compute == torch.float32 and head.gemv is not None
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    outs = llm.generate(PROMPTS[:1], params) + llm.generate(PROMPTS, params)
    assert all(len(o.outputs[0].token_ids) == 6 for o in outs)
    assert compiled.graphs == MAX_GRAPHS and compiled.runs > 0
    graph_rows = seen - {(True, torch.bfloat16), (False, torch.bfloat16)}  # eager calls: the LM head
    assert graph_rows == {(False, torch.float32)}, seen
    assert (True, torch.bfloat16) in seen
    llm.shutdown()
