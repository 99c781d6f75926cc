"""Speculative decoding on the CUDA path without a GPU (``fake_cuda.py``): drafts verified as
device chunks (the Triton paged-prefill kernel) and as CPU rows over the host pool, greedy and
seeded requests (their generators rewound on the device), in every offload mode, each iteration
mixing no devices and waiting for the device once, as without speculation."""

from __future__ import annotations

import pytest
from conftest import assert_all_blocks_free
from neo_rs import SamplingParams
from test_fake_cuda import MODES, engine_on, fake_gpu, run

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
