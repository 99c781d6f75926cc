"""The activation reserve is planned, not guessed (``worker/memory_plan.py``): for a Llama-3-8B
shape at the default token budget and ``max_num_seqs``, the engine's worst iterations in every
offload mode, traced on fake CUDA under torch's MemTracker, stay within the plan the runner
sized its pools by; a plan made for a smaller iteration fails the same check."""

from __future__ import annotations

import dataclasses

import pytest
from fake_cuda import GIB
from neo_rs.model.loader import empty_model
from neo_rs.worker.memory_plan import (
    WORST_ROW,
    AllocationTracker,
    MemoryPlanError,
    peak_beyond,
    plan_activations,
)
from test_fake_cuda import engine_on, fake_gpu, fake_weights, llama3_8b_shaped

SEQS, TOKENS = 256, 2048  # max_num_seqs and the token budget, the defaults


def worst_iterations_peak(engine, steps: int = 2) -> int:  # noqa: ANN001
    """The peak beyond the weights and pools over the first ``steps`` iterations of ``SEQS``
    prompts that fill the token budget, every row sampled the plan's worst way."""
    for i in range(SEQS):
        engine.add_request([3 + i % 100] * (TOKENS // SEQS), dataclasses.replace(WORST_ROW, max_tokens=2))
    runner = engine.runner
    tracker = AllocationTracker()
    tracker.track_external(runner.model, runner.device_pool.k, runner.device_pool.v)
    with tracker:
        for _ in range(steps):
            engine.step()
    return peak_beyond(tracker, runner.device)


@pytest.mark.parametrize("offload", ["none", "neo", "all"])
def test_the_worst_iteration_fits_the_plan(monkeypatch, tmp_path, offload: str) -> None:
    with fake_gpu(monkeypatch, total_bytes=141 * GIB) as checks:
        path = llama3_8b_shaped(tmp_path, 4)
        fake_weights(monkeypatch, checks, path)
        engine = engine_on(
            str(path), skip_tokenizer_init=True, offload=offload, block_size=16, max_model_len=4096
        )
        plan = engine.runner.activation_plan
        assert plan is not None and (plan.tokens, plan.rows) == (TOKENS, SEQS)
        measured = worst_iterations_peak(engine)
        plan.check(measured)
        # A plan traced for a quarter of the tokens keeps too little for this iteration.
        runner = engine.runner
        small = plan_activations(
            lambda: empty_model(engine.model_config, engine.dtype, runner.device, 4096),
            runner.attention.kinds,
            runner.device,
            TOKENS // 4,
            SEQS // 4,
        )
        with pytest.raises(MemoryPlanError, match="planned for 512 tokens"):
            small.check(measured)
        print(f"{offload}: traced {measured / 2**20:.0f} MiB, planned {plan.peak_bytes / 2**20:.0f} MiB")
        engine.shutdown()
