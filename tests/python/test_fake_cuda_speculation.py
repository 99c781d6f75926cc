"""Speculative decoding on the CUDA path without a GPU (``fake_cuda.py``): drafts verified as
device chunks (the Triton paged-prefill kernel) and as CPU rows over the host pool, greedy and
seeded requests (their generators rewound on the device), in every offload mode, each iteration
mixing no devices and waiting for the device once, as without speculation."""

from __future__ import annotations

import pytest
from conftest import assert_all_blocks_free
from neo_rs import SamplingParams
from test_fake_cuda import MODES, SYNCS_PER_ITERATION, engine_on, fake_gpu, run

NGRAM = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1, "prompt_lookup_max": 2}
SEEDED = SamplingParams(temperature=1.0, top_k=5, seed=3, max_tokens=8, ignore_eos=True)


@pytest.mark.parametrize("mode", ["none", "neo-forced", "all"])
def test_drafts_are_verified_on_the_cuda_path(monkeypatch: pytest.MonkeyPatch, mode: str) -> None:
    monkeypatch.setenv("NEO_RS_FORCE_SPECULATION", "1")
    kw, expected = MODES[mode]
    # The device's tokens are made up: always 7, which the prompts hold, so lookup drafts 7s
    # and every draft holds.
    with fake_gpu(monkeypatch, values=lambda t: [7] * t.numel()) as checks:
        engine = engine_on("demo", speculative_config=NGRAM, **kw)
        for i in range(4):
            params = SEEDED if i % 2 else SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
            engine.add_request([5, 7, 9, 7, 11] * (2 + i), params)
        drafted, step = [], engine.step

        def counting() -> list:
            outs = step()
            if (s := engine.last_stats) is not None:
                drafted.append((s.num_draft_tokens, sum(s.accepted_per_position)))
            return outs

        engine.step = counting  # type: ignore[method-assign]
        modes = run(engine, checks)
        assert expected & set(modes), modes
        assert sum(d for d, _ in drafted) > 0 and sum(a for _, a in drafted) > 0, drafted
        assert_all_blocks_free(engine)
        engine.shutdown()


@pytest.mark.parametrize("mode", ["none", "neo-forced"])
def test_a_draft_model_drafts_on_the_cuda_path(monkeypatch: pytest.MonkeyPatch, mode: str) -> None:
    # The draft model (the demo model for itself) runs on the device beside the model, its pool
    # its own. Each of its rounds waits for the device once (its tokens feed the next round
    # through its scheduler); the rest of an iteration as without it.
    monkeypatch.setenv("NEO_RS_FORCE_SPECULATION", "1")
    kw, expected = MODES[mode]
    with fake_gpu(monkeypatch, values=lambda t: [7] * t.numel()) as checks:
        spec = {"method": "draft_model", "model": "demo", "num_speculative_tokens": 3}
        engine = engine_on("demo", speculative_config=spec, **kw)
        for i in range(4):
            params = SEEDED if i % 2 else SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
            engine.add_request([5, 7, 9, 11] * (2 + i), params)
        drafter, rounds, modes, accepted = engine.drafter, [0], set(), 0
        execute = drafter.runner.execute

        def counting(plan):  # noqa: ANN001, ANN202
            rounds[0] += 1
            return execute(plan)

        drafter.runner.execute = counting  # type: ignore[method-assign]
        while engine.has_unfinished():
            before, rounds[0] = checks.syncs, 0
            engine.step()
            if (s := engine.last_stats) is not None:
                modes.add(s.mode)
                accepted += sum(s.accepted_per_position)
                assert checks.syncs - before == 1 + rounds[0], s
        assert expected & modes and accepted > 0, (modes, accepted)
        assert_all_blocks_free(engine)
        engine.shutdown()


@pytest.mark.parametrize("backend", ["triton", "torch"])
def test_device_drafts_verify_in_one_decode_launch(monkeypatch: pytest.MonkeyPatch, backend: str) -> None:
    """Beside device decodes alone, the verifying chunks fold into decode rows, each at its own
    position: every row's K/V is written to the pool first, every layer attends the whole batch
    in one call of the device decode backend, no paged prefill runs for them, and the device is
    waited for once a step, as without speculation."""
    monkeypatch.setenv("NEO_RS_FORCE_SPECULATION", "1")
    kw, _ = MODES["none"]
    with fake_gpu(monkeypatch, backend, values=lambda t: [7] * t.numel()) as checks:
        engine = engine_on("demo", speculative_config=NGRAM, **kw)
        for i in range(3):
            engine.add_request([5, 7, 9, 7, 11] * (2 + i), SamplingParams(temperature=0, max_tokens=8))
        attention = engine.runner.attention
        decode_rows: list[int] = []
        later_chunks: list[int] = []
        writes: list[list[tuple[int, int]]] = []
        decode, prefill, device_part = attention.decode, attention.prefill, attention.device_part

        def parting(q, k, v, pool, layer, batch, out, clock):  # noqa: ANN001, ANN202
            writes.append([(r.start, r.stop) for r, _ in batch.device_writes])
            return device_part(q, k, v, pool, layer, batch, out, clock)

        def decoding(q, pool, layer, rows, out, new_kv=None):  # noqa: ANN001, ANN202
            decode_rows.append(len(rows))
            return decode(q, pool, layer, rows, out, new_kv)

        def prefilling(q, k, v, pool, layer, p):  # noqa: ANN001, ANN202
            later_chunks.append(p.num_computed)
            return prefill(q, k, v, pool, layer, p)

        monkeypatch.setattr(attention, "decode", decoding)
        monkeypatch.setattr(attention, "prefill", prefilling)
        monkeypatch.setattr(attention, "device_part", parting)
        verifying = []
        while engine.has_unfinished():
            decode_rows.clear()
            writes.clear()
            before = checks.syncs
            engine.step()
            assert checks.syncs - before == SYNCS_PER_ITERATION  # the fold reads host tables only
            if (s := engine.last_stats) is not None and s.num_draft_tokens:
                verifying.append(s.num_draft_tokens)
                # Every layer: one decode call over a row per token of the batch (a verifying
                # decode is planned as a chunk: one of num_prefills, its drafts the other rows).
                rows = s.num_gpu_decodes + s.num_prefills + s.num_draft_tokens
                assert decode_rows and set(decode_rows) == {rows}, (decode_rows, s)
                assert writes and all(w == [(0, rows)] for w in writes), writes
        assert verifying, "no step verified drafts"
        assert not [c for c in later_chunks if c > 0], later_chunks
        assert_all_blocks_free(engine)
        engine.shutdown()
