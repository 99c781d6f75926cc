"""Speculative decoding by prompt lookup: greedy tokens identical to decoding without it in every
offload mode (drafts verified over the device pool and, in the CPU kernel, over the host pool),
under preemption, chunked prefill and prefix caching, under grammars; sampled
tokens keep the model's distribution (and a seed's tokens); bad settings are typed errors naming
the field."""

from __future__ import annotations

import json
from collections import Counter

import numpy as np
import pytest
import torch
from conftest import assert_all_blocks_free
from neo_rs import LLM, LLMEngine, SamplingParams
from neo_rs.engine.sequence import Sequence
from neo_rs.engine.speculation import Verification
from neo_rs.errors import InvalidArgumentError
from neo_rs.sample.sampling import sample
from neo_rs.serve.cli import parse_args
from server_util import Server

NGRAM = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 1, "prompt_lookup_max": 3}
# Prompts that repeat themselves, as edits and quotes do: lookup finds drafts in them at once.
PROMPTS = [[5, 9, 200, 31] * 4, list(range(10, 30)) * 2, [7, 8, 7, 8, 7], list(range(100, 137))]
GREEDY = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
FORCE = {"NEO_RS_FORCE_SPECULATION": "1"}


@pytest.fixture(autouse=True)
def _every_draft_verified(monkeypatch: pytest.MonkeyPatch) -> None:
    """Drafts whatever this machine's profile says they are worth, so every test verifies some
    (the priced choice is tested in ``tests/speculation.rs``)."""
    for k, v in FORCE.items():
        monkeypatch.setenv(k, v)


def _cpu_verifications(plan) -> int:  # noqa: ANN001 (a SchedulerOutput)
    """Requests of the plan that verify drafts with their attention on the CPU."""
    ids = plan.sample_ids.tolist()
    n, s1 = len(plan.req_ids), plan.sub_batch1_start
    cpu = [*range(plan.num_decodes - plan.num_cpu_decodes, plan.num_decodes), *range(s1, n)]
    return sum(ids.count(int(plan.req_ids[i])) > 1 for i in cpu)


def generate(
    model: str, spec: dict | None, prompts=PROMPTS, params=GREEDY, rounds=1, **kwargs
) -> tuple[list, LLMEngine, Counter]:  # noqa: ANN001
    """Tokens per prompt, the engine (shut down), and what its iterations did: draft tokens
    verified and accepted, drafts verified in the CPU kernel, and the scheduler's counters. Each
    later round's prompts are the last round's prompts followed by their outputs."""
    llm = LLM(model, dtype="float32", speculative_config=spec, **kwargs)
    engine, seen = llm.engine, Counter()
    step, execute = engine.step, engine.runner.execute

    def counting_execute(plan):  # noqa: ANN001, ANN202
        seen["cpu_verifications"] += _cpu_verifications(plan)
        return execute(plan)

    def counting_step() -> list:
        outs = step()
        if (s := engine.last_stats) is not None:
            seen["drafts"] += s.num_draft_tokens
            seen["accepted"] += sum(s.accepted_per_position)
        return outs

    engine.runner.execute = counting_execute  # type: ignore[method-assign]
    engine.step = counting_step  # type: ignore[method-assign]
    tokens: list[list[int]] = []
    with llm:
        for _ in range(rounds):
            outs = llm.generate(prompts, params, use_tqdm=False)
            tokens += [o.outputs[0].token_ids for o in outs]
            prompts = [list(o.prompt_token_ids) + o.outputs[0].token_ids for o in outs]
        assert_all_blocks_free(engine)
        seen.update(engine.scheduler.stats())
        if engine.drafter is not None:
            seen["draft_blocks"] = engine.drafter.runner.num_gpu_blocks
            seen["draft_recomputed"] = engine.drafter.scheduler.stats()["num_recomputed"]
    return tokens, engine, seen


# Tiny pools: requests are preempted (swapped, under `none`), prompts chunked, and under `neo`
# most decodes (and their drafts) run on the CPU over the host pool.
MODES: dict[str, dict] = {
    "none": {"num_gpu_blocks": 10, "num_cpu_blocks": 64, "block_size": 8},
    "neo": {
        "offload": "neo",
        "num_gpu_blocks": 10,
        "num_cpu_blocks": 64,
        "block_size": 8,
        "neo_force_pipeline": True,
    },
    "all": {
        "offload": "all",
        "num_gpu_blocks": 16,
        "num_cpu_blocks": 64,
        "block_size": 8,
        "max_num_batched_tokens": 24,
    },
}


@pytest.mark.parametrize("mode", MODES)
def test_greedy_tokens_are_those_without_speculation(checkpoints, mode: str) -> None:
    path = str(checkpoints["llama3"])
    want, _, _ = generate(path, None, **MODES[mode])
    got, engine, seen = generate(path, NGRAM, **MODES[mode])
    assert got == want
    assert seen["accepted"] > 0 and seen["drafts"] > seen["accepted"], seen  # both outcomes ran
    if mode != "none":
        assert seen["cpu_verifications"] > 0, seen
    if mode == "none":
        assert seen["num_swapped_out"] > 0


def test_prefix_hits_over_verified_tokens_and_stops_inside_accepted_drafts() -> None:
    # Round 2's prompts are round 1's prompts and outputs: they hit the blocks round 1 cached,
    # outputs and accepted drafts included (never a rejected draft's KV). Stop ids end some
    # sequences inside a run of accepted drafts. Penalties count each row's drafts before it.
    params = SamplingParams(
        temperature=0, max_tokens=40, stop_token_ids=[77], repetition_penalty=1.1, frequency_penalty=0.05
    )
    want, _, _ = generate("demo", None, PROMPTS, params, rounds=2, block_size=8)
    got, engine, seen = generate("demo", NGRAM, PROMPTS, params, rounds=2, block_size=8)
    assert got == want and seen["accepted"] > 0, seen
    assert seen["prefix_cache_hits"] > 0


def test_grammars_mask_every_draft_position() -> None:
    # The demo model under "(ab)+c" repeats "ab": its drafts are verified with each row masked
    # as the grammar stands after the drafts before it, beside unconstrained requests.
    free = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    constrained = SamplingParams(temperature=0, max_tokens=24, structured_outputs={"regex": "(ab)+c"})
    prompts = ["abababab", "the the the the", "abab"]
    for params in ([constrained], [free, free, constrained]):
        want, _, _ = generate("demo", None, prompts[-len(params) :], params)
        got, _, seen = generate("demo", NGRAM, prompts[-len(params) :], params)
        assert got == want and seen["accepted"] > 0, seen


def test_seeded_sampling_draws_the_tokens_it_draws_without_speculation() -> None:
    # Top-3: the random demo model's tokens then recur, so prompt lookup drafts, and half its
    # drafts or more are rejected (each having drawn a number from the seed's generator).
    params = SamplingParams(temperature=1.0, top_k=3, seed=7, max_tokens=24, logprobs=2, ignore_eos=True)
    want, _, _ = generate("demo", None, PROMPTS, params)
    got, _, seen = generate("demo", NGRAM, PROMPTS, params)
    assert got == want and seen["accepted"] > 0, seen
    with LLM("demo", speculative_config=NGRAM) as llm:
        out = llm.generate(PROMPTS[0], params, use_tqdm=False)[0].outputs[0]
    assert len(out.logprobs) == len(out.token_ids) == 24
    assert all(t in lp for t, lp in zip(out.token_ids, out.logprobs, strict=True))


def _chi2(counts: np.ndarray, p: torch.Tensor) -> float:
    expected = p.double().numpy() * counts.sum()
    return float(((counts - expected) ** 2 / expected).sum())


def test_sampled_tokens_keep_the_distribution() -> None:
    # 20,000 sequences over 6 tokens, each verifying one draft: the first token must follow p0,
    # the token after an accepted draft p1 (chi-square, 5 degrees of freedom, 1e-3 significance:
    # 20.52), and the draft is accepted with probability p0(draft).
    torch.manual_seed(0)
    logits = torch.randn(2, 6) * 1.5
    p0, p1 = logits.softmax(-1)
    n = 20_000
    for draft in (int(p0.argmin()), int(p0.argmax())):
        engine_rows = [
            Sequence(i, 0, SamplingParams(temperature=1.0), [1], set(), None, None) for i in range(n)
        ]
        v = Verification(engine_rows, [slice(2 * i, 2 * i + 2) for i in range(n)], [], [draft, None] * n)
        v.rows = [r for seq in engine_rows for r in (seq.sample_row(), seq.sample_row([draft]))]
        result = sample(logits.repeat(n, 1), v.rows, torch.Generator().manual_seed(1))
        v.emit(result)
        first = np.bincount([seq.output_ids[0] for seq in engine_rows], minlength=6)
        after = np.bincount(
            [seq.output_ids[1] for seq in engine_rows if len(seq.output_ids) == 2], minlength=6
        )
        assert _chi2(first, p0) < 20.52 and _chi2(after, p1) < 20.52, (draft, first, after)
        assert abs(sum(v.accepted) / n - float(p0[draft])) < 4 * (float(p0[draft]) / n) ** 0.5 + 1e-3


@pytest.mark.parametrize(
    ("config", "field"),
    [
        ({"method": "eagle", "num_speculative_tokens": 2}, "method"),
        ({"method": "draft_model", "model": "x", "num_speculative_tokens": 2}, "model"),
        ({"method": "ngramm", "num_speculative_tokens": 2}, "method"),
        ({"method": "ngram", "num_speculative_tokens": 0}, "num_speculative_tokens"),
        ({"method": "ngram", "num_speculative_tokens": 17}, "num_speculative_tokens"),
        ({"method": "ngram"}, "num_speculative_tokens"),
        (
            {"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": 4, "prompt_lookup_max": 2},
            "prompt_lookup_min",
        ),
        ({"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_max": 0}, "prompt_lookup"),
        ("{not json", "JSON"),
    ],
)
def test_bad_settings_name_the_field(config, field: str) -> None:  # noqa: ANN001
    with pytest.raises(InvalidArgumentError, match=field):
        LLM("demo", speculative_config=config)


def test_the_server_flag_takes_the_json_and_refuses_bad_values(capsys: pytest.CaptureFixture[str]) -> None:
    args = parse_args(["--speculative-config", '{"method": "ngram", "num_speculative_tokens": 3}'])
    assert args.speculative_config.scheduler_args() == (3, (5, 5), False)  # vLLM's lookup default
    with pytest.raises(SystemExit) as e:
        parse_args(["--speculative-config", '{"method": "ngram", "num_speculative_tokens": 99}'])
    assert e.value.code == 2 and "num_speculative_tokens" in capsys.readouterr().err


def test_two_ranks_verify_drafts_as_one_rank_decodes(checkpoints) -> None:
    path = str(checkpoints["llama3"])
    want, _, _ = generate(path, None, **MODES["neo"])
    got, _, seen = generate(path, NGRAM, tensor_parallel_size=2, **MODES["neo"])
    assert got == want and seen["accepted"] > 0 and seen["cpu_verifications"] > 0, seen


def test_the_server_streams_verified_tokens_and_counts_drafts() -> None:
    server = Server("--speculative-config", json.dumps(NGRAM), env=FORCE)
    try:
        client = server.client()
        prompt = PROMPTS[0]  # token ids (the random demo model repeats after these)
        chunks = client.completions.create(
            model="neo-rs-demo", prompt=prompt, max_tokens=48, temperature=0, stream=True
        )
        streamed = "".join(c.choices[0].text for c in chunks if c.choices)
        plain = client.completions.create(model="neo-rs-demo", prompt=prompt, max_tokens=48, temperature=0)
        assert streamed == plain.choices[0].text and plain.usage.completion_tokens == 48
        drafted = server.metric("neo:spec_decode_draft_tokens_total")
        accepted = server.metric("neo:spec_decode_accepted_tokens_total")
        first = server.metric("neo:spec_decode_num_accepted_tokens_per_pos_total", position="0")
        assert drafted >= accepted > 0 and 0 < first <= accepted
        assert server.metric("neo:spec_decode_num_drafts_total") > 0
    finally:
        assert server.stop() == 0
