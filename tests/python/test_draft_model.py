"""Speculative decoding with a draft model: greedy tokens identical to decoding without it in
every offload mode (the draft model's tokens verified over the device pool and, in the CPU
kernel, over the host pool), with its own pool too small to hold every request; seeded sampling
unchanged; a draft model that fails takes its step's requests down with it, and every block of
both models' pools comes back; bad settings name the field."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch
from conftest import assert_all_blocks_free
from neo_rs import LLM, SamplingParams
from neo_rs.engine import draft_model
from neo_rs.errors import EngineStepError, InvalidArgumentError
from neo_rs.serve.cli import parse_args
from safetensors.torch import load_file, save_file
from test_speculation import FORCE, MODES, PROMPTS, generate


@pytest.fixture(autouse=True)
def _every_draft_verified(monkeypatch: pytest.MonkeyPatch) -> None:
    for k, v in FORCE.items():
        monkeypatch.setenv(k, v)


@pytest.fixture(scope="module")
def near_copy(checkpoints, tmp_path_factory: pytest.TempPathFactory) -> str:  # noqa: ANN001
    """The llama3 test checkpoint with 2% noise on every matrix: as a draft, it agrees with the
    checkpoint often, not always."""
    path = tmp_path_factory.mktemp("draft") / "near-llama3"
    shutil.copytree(checkpoints["llama3"], path)
    g = torch.Generator().manual_seed(0)
    weights = load_file(Path(path) / "model.safetensors")
    for name, w in weights.items():
        if w.dim() == 2:
            weights[name] = w + 0.02 * w.std() * torch.randn(w.shape, generator=g, dtype=w.dtype)
    save_file(weights, Path(path) / "model.safetensors", metadata={"format": "pt"})
    return str(path)


def draft(model: str, k: int = 4) -> dict:
    return {"method": "draft_model", "model": model, "num_speculative_tokens": k}


@pytest.mark.parametrize("mode", MODES)
def test_greedy_tokens_are_those_without_speculation(checkpoints, near_copy: str, mode: str) -> None:
    target = str(checkpoints["llama3"])
    want, _, _ = generate(target, None, **MODES[mode])
    got, engine, seen = generate(target, draft(near_copy), **MODES[mode])
    assert got == want
    assert seen["accepted"] > 0 and seen["drafts"] > seen["accepted"], seen  # both outcomes ran
    if mode != "none":
        assert seen["cpu_verifications"] > 0, seen
    assert seen["draft_blocks"] > 0  # generate() found both models' pools free at the end


def test_a_draft_pool_too_small_for_every_request_recomputes(checkpoints, monkeypatch) -> None:  # noqa: ANN001
    # Room for 6 blocks of 8 tokens: the four requests cannot all be held, so the draft model's
    # scheduler preempts and recomputes, and a request longer than its pool drafts nothing.
    # The model drafts for itself: its KV follows the target's exactly, every draft holds.
    target = str(checkpoints["llama3"])
    probe = LLM(target, dtype="float32", speculative_config=draft(target), block_size=8)
    per_block = probe.engine.drafter.runner.layout.bytes_per_block()
    probe.shutdown()
    monkeypatch.setattr(draft_model, "DRAFT_KV_BYTES", 6 * per_block)
    want, _, _ = generate(target, None, block_size=8)
    got, engine, seen = generate(target, draft(target), block_size=8)
    assert got == want and seen["accepted"] == seen["drafts"] > 0, seen
    assert seen["draft_blocks"] == 6 and seen["draft_recomputed"] > 0, seen


class _Recording:
    """The target's scheduler as the draft model sees it, keeping each request's tokens and the
    drafts proposed after them."""

    def __init__(self, target, tokens_of, seen: list) -> None:  # noqa: ANN001
        self.target, self.tokens_of, self.seen = target, tokens_of, seen

    def __getattr__(self, name: str):  # noqa: ANN204
        return getattr(self.target, name)

    def propose(self, ids: list[int], tokens: list[int], counts: list[int]) -> None:
        at = 0
        for seq_id, n in zip(ids, counts, strict=True):
            self.seen.append((self.tokens_of(seq_id), tokens[at : at + n]))
            at += n
        self.target.propose(ids, tokens, counts)


def test_drafts_are_the_draft_models_own_greedy_tokens(checkpoints, near_copy: str) -> None:
    # Whatever the target rejected before, each draft is what the draft model alone continues the
    # target's tokens with: its KV follows the target's, rejected drafts' rolled back.
    seen: list[tuple[list[int], list[int]]] = []
    llm = LLM(str(checkpoints["llama3"]), dtype="float32", speculative_config=draft(near_copy), block_size=8)
    drafter = llm.engine.drafter
    step = drafter.step
    drafter.step = lambda target, tokens_of: step(_Recording(target, tokens_of, seen), tokens_of)
    with llm:
        llm.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=24, ignore_eos=True), use_tqdm=False)
    with LLM(near_copy, dtype="float32") as alone:
        outs = alone.generate(
            [{"prompt_token_ids": tokens} for tokens, _ in seen],
            [SamplingParams(temperature=0, max_tokens=len(d), ignore_eos=True) for _, d in seen],
            use_tqdm=False,
        )
    assert len(seen) > 20
    assert [o.outputs[0].token_ids for o in outs] == [d for _, d in seen]


def test_seeded_sampling_draws_the_tokens_it_draws_without_speculation() -> None:
    # The demo model drafting for itself: its argmax is often, not always, what the seed draws.
    params = SamplingParams(temperature=1.0, top_k=3, seed=7, max_tokens=24, ignore_eos=True)
    want, _, _ = generate("demo", None, PROMPTS, params)
    got, _, seen = generate("demo", draft("demo"), PROMPTS, params)
    assert got == want and seen["drafts"] > seen["accepted"] > 0, seen


def test_a_failing_draft_model_fails_its_step_and_frees_every_block() -> None:
    llm = LLM("demo", speculative_config=draft("demo"))
    engine = llm.engine
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    ids = [engine.add_request(p, params) for p in PROMPTS[:2]]
    engine.step()  # the prompts: nothing to draft for yet

    def broken(plan):  # noqa: ANN001, ANN202
        raise RuntimeError("out of memory")

    engine.drafter.runner.execute = broken  # type: ignore[method-assign]
    with pytest.raises(EngineStepError, match="draft model failed") as e:
        engine.step()
    assert sorted(e.value.request_ids) == sorted(ids)
    assert_all_blocks_free(engine)  # the draft model's pool too
    llm.shutdown()


@pytest.mark.parametrize(
    ("config", "field"),
    [
        (draft("/nonexistent/draft"), "speculative_config.model"),
        ({"method": "draft_model", "num_speculative_tokens": 2}, "speculative_config.model"),
        ({**draft("demo"), "prompt_lookup_max": 3}, "prompt_lookup_max"),
        ({"method": "ngram", "model": "demo", "num_speculative_tokens": 2}, "speculative_config.model"),
        (draft("demo", 17), "num_speculative_tokens"),
    ],
)
def test_bad_settings_name_the_field(config: dict, field: str) -> None:
    with pytest.raises(InvalidArgumentError, match=field):
        LLM("demo", speculative_config=config)


def test_a_draft_model_of_another_vocabulary_is_refused(checkpoints) -> None:
    # The demo model has 258 tokens, the test checkpoints 300.
    with pytest.raises(InvalidArgumentError, match="speculative_config.model .* vocabulary of 300"):
        LLM("demo", speculative_config=draft(str(checkpoints["llama"])))


def test_the_server_flag_takes_a_model_without_a_method() -> None:
    args = parse_args(["--speculative-config", '{"model": "demo", "num_speculative_tokens": 3}'])
    assert (args.speculative_config.method, args.speculative_config.model) == ("draft_model", "demo")
    assert args.speculative_config.scheduler_args() == (3, None, False)
