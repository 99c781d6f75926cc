"""Prepacked bf16 linears on the CPU (oneDNN): bit-identical to ``F.linear`` at any row count, in
place of every linear that owns its weight, and the same tokens end to end."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from neo_rs import LLM, SamplingParams
from neo_rs.model.packed import PackedLinear, pack_linears, packing_applies
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
    assert pack_linears(model, rows=8) == 2
    assert isinstance(model[1], PackedLinear) and isinstance(model[2], PackedLinear)
    x = torch.randn(9, 16, dtype=torch.bfloat16)
    assert torch.equal(model[2](x), F.linear(x, model[0].weight))


def test_same_tokens_with_and_without_packing(monkeypatch: pytest.MonkeyPatch) -> None:
    # oneDNN on its packed weight is bit for bit ``F.linear``; the Rust kernel that takes batches
    # of a few rows (and sums in another order) is left out, so that packing alone is compared.
    monkeypatch.setenv("NEO_RS_ROW_GEMV", "0")
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
