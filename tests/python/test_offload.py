"""The offload tier around the model: iteration stats, the perf profile cache and the
predictor's online correction, and the CPU-attention timer."""

from __future__ import annotations

import json
import time

import pytest
import torch
from conftest import assert_all_blocks_free
from neo_rs import LLM, CpuAttention, LLMEngine, SamplingParams
from neo_rs.environment import cache_dir
from neo_rs.worker.profiler import PerfTables, load_or_profile, profile_key


def pipelined_engine(model: str) -> LLMEngine:
    """A neo engine whose device pool is too small for its six queued requests, every CPU decode
    forced into the pipeline."""
    llm = LLM(
        model,
        dtype="float32",
        offload="neo",
        num_gpu_blocks=10,
        num_cpu_blocks=64,
        block_size=8,
        neo_force_pipeline=True,
    )
    p = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    for i in range(6):
        llm.engine.add_request(list(range(3, 30 + i)), p)
    return llm.engine


def test_pipelined_iterations_report_what_ran_where(checkpoints) -> None:
    engine = pipelined_engine(str(checkpoints["llama3"]))
    seen = []
    while engine.has_unfinished():
        engine.step()
        assert engine.last_stats is not None
        seen.append(engine.last_stats)
        if len(seen) == 6:  # a late prompt, prefilled beside running decodes
            engine.add_request([4, 8, 15, 16, 23, 42], SamplingParams(max_tokens=4))
    piped = [s for s in seen if s.mode == "pipelined"]
    assert piped, [s.mode for s in seen]
    s = piped[0]
    assert s.num_cpu_decodes > 0 and s.cpu_attn_ms > 0 and s.transfer_bytes > 0
    assert s.predicted_layer_ms["layer"] > 0 and s.predicted_layer_ms["cpu_attn1"] > 0
    # Every stage that ran is measured in every mode, mixed and pipelined iterations included
    # (before, only single-kind sequential iterations measured device stages, never copies).
    for s in seen:
        m = s.measured_layer_ms
        assert "linear" in m, s
        assert ("gpu_decode" in m) == (s.num_gpu_decodes > 0), s
        assert ("prefill_attn" in m) == (s.num_prefills > 0), s
        assert ("cpu_attn" in m) == (s.num_cpu_decodes > 0), s
        assert "copy" in m or not s.num_cpu_decodes, s  # and for host-bound prefills' rows
    assert any(s.num_prefills and s.num_gpu_decodes for s in seen), "a mixed iteration ran"
    # ... and each term's measurement moved its correction off 1.
    corrections = dict(engine.scheduler.perf_corrections())
    for term in ("linear", "prefill_attn", "gpu_decode", "cpu_decode", "transfer"):
        assert corrections[term] != 1.0, corrections
    assert all(s.cpu_blocks_total == 64 and s.gpu_blocks_total == 10 for s in seen)
    assert_all_blocks_free(engine)


def test_profile_is_cached_per_key_and_corrections_move(checkpoints) -> None:
    llm = LLM(
        str(checkpoints["llama"]),
        dtype="float32",
        offload="neo",
        num_gpu_blocks=32,
        max_num_batched_tokens=64,
    )
    runner = llm.engine.runner
    key = profile_key(runner, 64)
    path = cache_dir() / "profiles" / f"{key}.json"
    assert path.is_file()
    tables = PerfTables.from_json(json.loads(path.read_text()))
    assert tables.linear[0][-1] == 64 and all(y >= 0 for y in tables.linear[1])
    for grid in (tables.gpu_decode, tables.cpu_decode):
        assert len(grid[2]) == len(grid[0]) * len(grid[1]) and min(grid[2]) > 0
    # A different budget is a different key; the same key reads the file back.
    assert profile_key(runner, 128) != key
    assert load_or_profile(runner, 64, 512, cache_dir()) == tables
    s = llm.engine.scheduler
    before = dict(s.perf_corrections())
    # A stage whose uncorrected estimate is 1.5 ms keeps measuring 3 ms: each prediction is that
    # estimate times the current correction, and the correction heads for 2.
    for _ in range(200):
        s.observe("linear", 1.5 * dict(s.perf_corrections())["linear"], 3.0)
    after = dict(s.perf_corrections())
    assert 1.9 < after["linear"] <= 2.0 and after["cpu_decode"] == before["cpu_decode"]


def test_attention_handle_reports_kernel_time() -> None:
    attn = CpuAttention(num_threads=1)
    k = torch.randn(1, 8, 2, 16, 64)
    v = torch.randn_like(k)
    q, out = torch.randn(4, 4, 64), torch.empty(4, 4, 64)
    tables = torch.arange(8, dtype=torch.int32).reshape(4, 2)
    lens = torch.full((4,), 30, dtype=torch.int32)
    t = time.perf_counter()
    h = attn.submit(q, k, v, 0, tables, lens, 0.125, out)
    h.wait()
    wall_ms = (time.perf_counter() - t) * 1e3
    # The kernel's own time: positive, and within the wall time from submit to the end of wait.
    assert h.done() and h.run_ms is not None and 0 < h.run_ms <= wall_ms


@pytest.mark.parametrize("model", ["llama", "demo"])  # 2 and 4 layers
def test_the_host_waits_for_the_device_a_constant_number_of_times(checkpoints, model: str) -> None:
    engine = pipelined_engine(str(checkpoints["llama"]) if model == "llama" else "demo")
    modes = set()
    while engine.has_unfinished():
        engine.step()
        stats, waits = engine.last_stats, engine.runner.last_times.waits
        assert stats is not None
        modes.add(stats.mode)
        # One wait, for the stage timers, once the sampled tokens are read (the device is done
        # by then), in every mode. Never one per layer.
        assert waits.device == 1, (stats.mode, waits)
    assert "pipelined" in modes and len(modes) > 1, modes
    assert_all_blocks_free(engine)
