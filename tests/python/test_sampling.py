"""Sampling: seeded reproducibility independent of the batch, stop strings / ids, min_tokens,
n > 1, logprobs, penalties and the filters, and typed errors for bad parameters."""

from __future__ import annotations

import pytest
import torch
from conftest import assert_all_blocks_free
from neo_rs import LLM, InvalidArgumentError, RequestOutput, RequestOutputKind, SamplingParams
from neo_rs.sample.sampling import SampleRow, sample


@pytest.fixture(scope="module")
def llm(checkpoints) -> LLM:
    return LLM(str(checkpoints["llama3"]), dtype="float32", num_gpu_blocks=128)


def gen(llm: LLM, prompts, params):  # noqa: ANN001, ANN201
    outs = llm.generate(prompts, params, use_tqdm=False)
    assert_all_blocks_free(llm.engine)
    return outs


def test_seeded_sampling_is_independent_of_the_batch(llm: LLM) -> None:
    p = SamplingParams(temperature=1.0, top_p=0.9, seed=42, max_tokens=16, ignore_eos=True)
    alone = gen(llm, "hello", p)[0].outputs[0].token_ids
    others = SamplingParams(temperature=0.8, max_tokens=9, ignore_eos=True)
    batch = gen(llm, ["xyz", "hello", "a longer prompt here"], [others, p, others])
    assert batch[1].outputs[0].token_ids == alone
    other_seed = gen(
        llm, "hello", SamplingParams(temperature=1.0, top_p=0.9, seed=43, max_tokens=16, ignore_eos=True)
    )
    assert other_seed[0].outputs[0].token_ids != alone


def test_n_gives_independent_samples(llm: LLM) -> None:
    p = SamplingParams(n=3, temperature=1.0, seed=7, max_tokens=12, ignore_eos=True)
    out = gen(llm, "abc", p)[0]
    assert [o.index for o in out.outputs] == [0, 1, 2]
    tokens = [o.token_ids for o in out.outputs]
    assert len({tuple(t) for t in tokens}) == 3
    # Sample i is the seed + i stream of a single request.
    single = gen(llm, "abc", SamplingParams(temperature=1.0, seed=8, max_tokens=12, ignore_eos=True))
    assert single[0].outputs[0].token_ids == tokens[1]


def test_stop_token_ids_and_min_tokens(llm: LLM) -> None:
    free = gen(llm, "stop me", SamplingParams(temperature=0, max_tokens=20, ignore_eos=True))[0].outputs[0]
    stop_id = free.token_ids[4]
    first = free.token_ids.index(stop_id)
    out = gen(llm, "stop me", SamplingParams(temperature=0, max_tokens=20, stop_token_ids=[stop_id]))[
        0
    ].outputs[0]
    assert out.token_ids == free.token_ids[: first + 1]
    assert (out.finish_reason, out.stop_reason) == ("stop", stop_id)
    # min_tokens bans the stop id until enough tokens exist.
    p = SamplingParams(temperature=0, max_tokens=20, stop_token_ids=[stop_id], min_tokens=first + 3)
    out = gen(llm, "stop me", p)[0].outputs[0]
    assert len(out.token_ids) >= first + 3
    assert stop_id not in out.token_ids[: first + 2]


def test_stop_strings_cut_the_text(llm: LLM) -> None:
    prompt = "The quick brown fox"
    free = gen(llm, prompt, SamplingParams(temperature=0, max_tokens=24, ignore_eos=True))[0].outputs[0]
    text = free.text
    assert len(text) > 6, text
    stop = text[3:5]
    cut = text.index(stop)
    out = gen(llm, prompt, SamplingParams(temperature=0, max_tokens=24, stop=[stop]))[0].outputs[0]
    assert (out.text, out.finish_reason, out.stop_reason) == (text[:cut], "stop", stop)
    out = gen(
        llm, prompt, SamplingParams(temperature=0, max_tokens=24, stop=stop, include_stop_str_in_output=True)
    )
    assert out[0].outputs[0].text == text[: cut + len(stop)]


def test_eos_stops_unless_ignored(checkpoints) -> None:
    llm = LLM(str(checkpoints["llama"]), dtype="float32", num_gpu_blocks=64)
    free = gen(llm, "e", SamplingParams(temperature=0, max_tokens=16, ignore_eos=True))[0].outputs[0]
    llm.engine.eos_ids = {free.token_ids[2]}
    first = free.token_ids.index(free.token_ids[2])
    out = gen(llm, "e", SamplingParams(temperature=0, max_tokens=16))[0].outputs[0]
    assert out.token_ids == free.token_ids[: first + 1]
    assert (out.finish_reason, out.stop_reason) == ("stop", None)
    out = gen(llm, "e", SamplingParams(temperature=0, max_tokens=16, ignore_eos=True))[0].outputs[0]
    assert out.token_ids == free.token_ids and out.finish_reason == "length"


def test_logprobs(llm: LLM) -> None:
    out = gen(llm, "log", SamplingParams(temperature=0, max_tokens=5, logprobs=3, ignore_eos=True))[
        0
    ].outputs[0]
    assert out.logprobs is not None and len(out.logprobs) == 5
    for tok, entry in zip(out.token_ids, out.logprobs, strict=True):
        assert len(entry) == 3 and tok in entry
        assert entry[tok] == max(entry.values()) <= 0  # greedy picks the top-1
    assert out.cumulative_logprob == pytest.approx(
        sum(e[t] for t, e in zip(out.token_ids, out.logprobs, strict=True))
    )


def test_repetition_penalty_breaks_loops(checkpoints) -> None:
    llm = LLM(None, num_gpu_blocks=64)  # the demo model repeats itself under greedy decoding
    plain = gen(llm, "Hello", SamplingParams(temperature=0, max_tokens=24, ignore_eos=True))[0].outputs[0]
    p = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, repetition_penalty=5.0)
    penalised = gen(llm, "Hello", p)[0].outputs[0]
    assert len(set(penalised.token_ids)) > len(set(plain.token_ids))


def _row(**kw) -> SampleRow:  # noqa: ANN003
    return SampleRow(SamplingParams(**kw), prompt_ids=[0], output_ids=[], generator=None, banned_ids=[])


def test_sampler_filters_and_penalties() -> None:
    g = torch.Generator().manual_seed(0)
    logits = torch.tensor([[2.0, 1.9, 0.0, -1.0]])
    for kw in (dict(top_k=1), dict(top_p=0.01), dict(min_p=1.0), dict(temperature=0)):
        assert all(sample(logits, [_row(**kw)], g).token_ids == [0] for _ in range(20)), kw
    # top_k=2 never draws the tail.
    draws = {sample(logits, [_row(top_k=2, temperature=5.0)], g).token_ids[0] for _ in range(200)}
    assert draws == {0, 1}
    # A frequency penalty on token 0 (generated twice) makes token 1 the argmax.
    row = SampleRow(SamplingParams(temperature=0, frequency_penalty=0.1), [3], [0, 0], None, [])
    assert sample(logits, [row], g).token_ids == [1]
    # Repetition penalty covers prompt tokens too; banned ids are never drawn.
    row = SampleRow(SamplingParams(temperature=0, repetition_penalty=2.0), [0], [], None, [])
    assert sample(logits, [row], g).token_ids == [1]
    row = SampleRow(SamplingParams(temperature=0), [3], [], None, [0, 1])
    assert sample(logits, [row], g).token_ids == [2]


@pytest.mark.parametrize(
    "kw",
    [
        dict(temperature=-0.1),
        dict(top_p=0.0),
        dict(top_p=1.5),
        dict(top_k=-2),
        dict(min_p=2.0),
        dict(n=0),
        dict(max_tokens=0),
        dict(min_tokens=5, max_tokens=2),
        dict(presence_penalty=3.0),
        dict(repetition_penalty=0.0),
        dict(logprobs=100),
        dict(stop=[""]),
        dict(seed="x"),
        dict(seed=2**70),
        dict(temperature=float("nan")),
        dict(temperature=float("inf")),
        dict(repetition_penalty=float("nan")),
        dict(logit_bias={5: 101.0}),
        dict(logit_bias={-1: 1.0}),
        dict(logit_bias={5: float("nan")}),
    ],
)
def test_bad_parameters_raise_typed_errors(kw) -> None:  # noqa: ANN001
    with pytest.raises(InvalidArgumentError):
        SamplingParams(**kw)
    with pytest.raises(ValueError):  # what code written for vLLM catches
        SamplingParams(**kw)


def test_logit_bias_follows_openai_semantics() -> None:
    logits = torch.tensor([[0.0, 5.0, 1.0, 2.0]])
    assert sample(logits, [_row(temperature=0)], torch.Generator()).token_ids == [1]
    assert sample(logits, [_row(temperature=0, logit_bias={2: 100.0})], torch.Generator()).token_ids == [2]
    assert sample(logits, [_row(temperature=0, logit_bias={1: -100.0})], torch.Generator()).token_ids == [3]
    # A bias of -100 all but bans a token from sampled rows too.
    row = _row(temperature=1.0, logit_bias={1: -100.0})
    assert 1 not in sample(logits.repeat(200, 1), [row] * 200, torch.Generator().manual_seed(0)).token_ids


def test_bad_requests_raise_before_anything_is_scheduled(llm: LLM) -> None:
    with pytest.raises(InvalidArgumentError, match="unknown sampling parameter"):
        SamplingParams.from_dict({"temperature": 1.0, "best_of_all": 3})
    with pytest.raises(InvalidArgumentError, match="empty"):
        llm.generate(["fine", []], use_tqdm=False)
    with pytest.raises(InvalidArgumentError, match="context"):
        llm.generate([[1] * 600], use_tqdm=False)
    with pytest.raises(InvalidArgumentError, match="context"):
        llm.generate(["ok"], SamplingParams(max_tokens=10_000), use_tqdm=False)
    with pytest.raises(InvalidArgumentError, match="token ids"):
        llm.generate([[1, 99_999]], use_tqdm=False)
    with pytest.raises(InvalidArgumentError, match="logit_bias"):
        llm.generate(["ok"], SamplingParams(logit_bias={99_999: 1.0}), use_tqdm=False)
    with pytest.raises(InvalidArgumentError, match="max_num_seqs"):
        llm.generate(["ok"], SamplingParams(n=llm.engine.max_num_seqs + 1), use_tqdm=False)
    with pytest.raises(InvalidArgumentError, match="multi_modal_data"):
        llm.generate([{"prompt": "x", "multi_modal_data": {}}], use_tqdm=False)
    assert_all_blocks_free(llm.engine)


def test_prompts_may_be_vllm_prompt_dicts(llm: LLM) -> None:
    greedy = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    ids = llm.engine.tokenize("Hello")
    plain = llm.generate(["Hello", ids], greedy, use_tqdm=False)
    dicts = llm.generate([{"prompt": "Hello"}, {"prompt_token_ids": ids}], greedy, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in dicts] == [o.outputs[0].token_ids for o in plain]
    assert dicts[0].prompt == "Hello" and dicts[1].prompt_token_ids == ids
    one = llm.generate({"prompt_token_ids": ids}, greedy, use_tqdm=False)
    assert one[0].outputs[0].token_ids == plain[1].outputs[0].token_ids


def test_random_draws_follow_the_distribution() -> None:
    g = torch.Generator().manual_seed(0)
    logits = torch.tensor([[0.0, 1.0, 2.0, 3.0, float("-inf")]])
    counts = torch.zeros(5)
    for _ in range(4000):
        counts[sample(logits, [_row(temperature=1.0)], g).token_ids[0]] += 1
    assert counts[4] == 0
    torch.testing.assert_close(counts / 4000, logits.softmax(-1)[0], atol=0.02, rtol=0)


def test_random_draws_of_narrowed_and_plain_rows_in_one_batch() -> None:
    # A top-k row is filtered and divided by its temperature before the CPU draw, a plain row is
    # drawn in place at its own: each keeps its distribution (dividing twice would give the
    # first 0.68 / 0.32 instead of 0.82 / 0.18).
    g = torch.Generator().manual_seed(0)
    logits = torch.tensor([[3.0, 0.0, -5.0, -5.0], [0.0, 1.0, 2.0, 3.0]])
    rows = [_row(top_k=2, temperature=2.0), _row(temperature=1.0)]
    counts = torch.zeros(2, 4)
    for _ in range(3000):
        for i, t in enumerate(sample(logits, rows, g).token_ids):
            counts[i, t] += 1
    assert counts[0, 2:].sum() == 0
    torch.testing.assert_close(counts[0, :2] / 3000, (logits[0, :2] / 2).softmax(-1), atol=0.03, rtol=0)
    torch.testing.assert_close(counts[1] / 3000, logits[1].softmax(-1), atol=0.03, rtol=0)


def test_cpu_draws_are_torch_draws_in_every_simd_tier(monkeypatch: pytest.MonkeyPatch) -> None:
    """``draw_on_cpu`` (``_core.Categorical``, on a team of two) against ``draw_in_torch`` (the
    CUDA path: torch's sorted filters, then the inverse CDF) at the same uniforms, plain and
    narrowed rows in one batch, wherever the target is not within rounding of a boundary."""
    from neo_rs._core import simd_tiers
    from neo_rs.sample import sampling

    g = torch.Generator().manual_seed(0)
    logits = torch.randn(7, 5003, generator=g) * 4
    logits[torch.rand(7, 5003, generator=g) < 0.3] = float("-inf")
    logits[6] = torch.randn(5003, generator=g) * 0.3  # flat: a nucleus of thousands
    rows = [5, 0, 3, 3, 1, 2, 4, 6, 6]
    params = [
        SamplingParams(temperature=1.0),
        SamplingParams(temperature=0.5),
        SamplingParams(temperature=2.0, top_p=0.8),
        SamplingParams(temperature=1.0, top_k=20),
        SamplingParams(temperature=0.05),
        SamplingParams(temperature=0.7, top_k=50, top_p=0.9, min_p=0.05),
        SamplingParams(temperature=7.0, min_p=0.2),
        SamplingParams(temperature=0.8, top_p=0.95),
        SamplingParams(temperature=1.0, top_k=-1, top_p=0.5),
    ]
    probs = sampling._filter(logits[rows].double(), params).softmax(-1)
    cdf = probs.cumsum(-1)
    checked = 0
    for _ in range(20):
        u = torch.rand(len(rows), 1, generator=g)
        want = sampling.draw_in_torch(logits, rows, params, u)
        target = u.double() * cdf[:, -1:]
        below = torch.where(want > 0, cdf.gather(1, (want - 1).clamp(min=0)[:, None])[:, 0], 0.0)
        margin = torch.minimum(target[:, 0] - below, cdf.gather(1, want[:, None])[:, 0] - target[:, 0])
        far = margin > 1e-5
        for tier in simd_tiers():
            monkeypatch.setenv("NEO_RS_SIMD", tier)
            sampling._categorical.cache_clear()  # a sampler of the tier
            try:
                got = sampling.draw_on_cpu(logits, rows, params, u)
            finally:
                sampling._categorical.cache_clear()
            assert torch.isfinite(logits[rows, got]).all(), tier
            assert torch.equal(got[far], want[far]), (tier, got, want)
            checked += int(far.sum())
    assert checked > 100 * len(simd_tiers())


def test_bf16_logits_give_the_float32_tokens(monkeypatch: pytest.MonkeyPatch) -> None:
    """``compute_logits`` hands over the model's bf16: greedy rows read them as they are (the Rust
    argmax, every tier), any other row reads them widened; tokens and logprobs are those of the
    float32 copy."""
    from neo_rs._core import simd_tiers
    from neo_rs.sample import sampling

    g = torch.Generator().manual_seed(0)
    narrow = (torch.randn(5, 5003, generator=g) * 3).to(torch.bfloat16)
    narrow[1, [7, 4000]] = 20.0  # a tie: the first wins
    narrow[2] = float("-inf")
    narrow[3, :4990] = float("-inf")  # the largest past the last whole vector
    narrow[3, 5002] = 30.0
    wide = narrow.float()
    want = wide.max(dim=-1).indices.tolist()
    assert want[1:4] == [7, 0, 5002]
    for tier in simd_tiers():
        monkeypatch.setenv("NEO_RS_SIMD", tier)
        sampling._categorical.cache_clear()
        try:
            assert sample(narrow, [_row(temperature=0)] * 5, g).token_ids == want, tier
        finally:
            sampling._categorical.cache_clear()
    banned = SampleRow(
        SamplingParams(temperature=0), prompt_ids=[0], output_ids=[], generator=None, banned_ids=[want[0]]
    )
    mixed = [
        banned,
        _row(temperature=1.0, logprobs=2),
        _row(temperature=0),
        _row(temperature=0.5, top_k=3),
        _row(temperature=0, logit_bias={3: 100.0}),
    ]
    got, ref = (sample(x, mixed, torch.Generator().manual_seed(1)) for x in (narrow, wide))
    assert got == ref
    assert got.token_ids[0] != want[0] and got.token_ids[4] == 3


@pytest.mark.parametrize("stop", [[], ["e", "xyz"]])
def test_delta_outputs_add_up_to_the_cumulative_ones(llm: LLM, stop: list[str]) -> None:
    def run(kind: RequestOutputKind) -> list[list[RequestOutput]]:
        engine = llm.engine
        params = SamplingParams(n=2, seed=7, max_tokens=24, logprobs=1, stop=stop, output_kind=kind)
        rid = engine.add_request("The quick brown fox", params)
        outs = []
        while engine.has_unfinished():
            outs += [o for o in engine.step() if o.request_id == rid]
        return outs

    cumulative, delta, final = (run(k) for k in RequestOutputKind)
    assert len(final) == 1 and final[0].finished
    for i in range(2):
        whole = cumulative[-1].outputs[i]
        parts = [o.outputs[i] for o in delta]
        assert "".join(p.text for p in parts) == whole.text == final[0].outputs[i].text
        assert [t for p in parts for t in p.token_ids] == whole.token_ids
        assert [lp for p in parts for lp in (p.logprobs or [])] == whole.logprobs
        assert all(len(p.token_ids) <= 1 for p in parts)  # each output carries only what is new
    assert_all_blocks_free(llm.engine)
