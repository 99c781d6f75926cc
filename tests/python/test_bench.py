"""The serving benchmark: workloads and arrivals are seeded and shaped as documented, and a
short run against the real server on the demo model reports consistent figures."""

from __future__ import annotations

import json
import statistics
from pathlib import Path

import pytest
from neo_rs.bench import workloads
from neo_rs.bench.__main__ import main as bench_main
from neo_rs.bench.arrivals import arrival_times
from server_util import Server


def test_workloads_are_seeded_and_shaped() -> None:
    syn = workloads.synthetic(500, 1000, 200, seed=3)
    assert syn == workloads.synthetic(500, 1000, 200, seed=3) != workloads.synthetic(500, 1000, 200, seed=4)
    assert all(900 <= r.prompt_len <= 1100 and 180 <= r.output_len <= 220 for r in syn)
    osc = workloads.osc(2000, seed=0)
    assert all(29 <= r.prompt_len <= 589 and 15 <= r.output_len <= 129 for r in osc)
    assert abs(statistics.fmean(r.prompt_len for r in osc) - 372) < 15
    assert abs(statistics.fmean(r.output_len for r in osc) - 45) < 5
    code = workloads.azure_code(2000, seed=0)
    assert (
        statistics.median(r.prompt_len for r in code) > 1000
        and statistics.fmean(r.output_len for r in code) < 40
    )


def test_prompts_are_drawn_from_the_seed() -> None:
    a, b = (workloads.make("synthetic", 20, 40, 8, seed, vocab=1000) for seed in (0, 1))
    assert a == workloads.make("synthetic", 20, 40, 8, 0, vocab=1000)
    firsts = {r.ids[:16] for r in a + b if r.ids is not None}
    assert len(firsts) == 40  # no shared first block, within a run or across seeds


def test_shared_prefix_workload_resends_each_conversation() -> None:
    reqs = workloads.make("shared-prefix", 7, 50, 20, seed=1, prefix_len=300, turns=3, vocab=100)
    assert reqs == workloads.make("shared-prefix", 7, 50, 20, seed=1, prefix_len=300, turns=3, vocab=100)
    assert len(reqs) == 7 and all(r.ids is not None and len(r.ids) == r.prompt_len for r in reqs)
    ids = [r.ids or () for r in reqs]
    assert all(i[:300] == ids[0][:300] and max(i) < 100 for i in ids)
    # 3 conversations, turn-major: request 3 is conversation 0's second turn, which resends the
    # first turn and a 20-token stand-in for its reply before a new message.
    first, second = ids[0], ids[3]
    assert second[: len(first)] == first and len(second) >= len(first) + 20 + 45
    assert ids[1][300:305] != first[300:305]  # conversations differ after the system prompt


def test_arrivals() -> None:
    assert arrival_times(5, float("inf"), 1.0, 0) == [0.0] * 5
    t = arrival_times(4000, 10.0, 1.0, seed=1)
    assert t == sorted(t) and abs(t[-1] / 4000 - 0.1) < 0.01
    bursty = arrival_times(4000, 10.0, 0.25, seed=1)
    gaps = [b - a for a, b in zip(bursty, bursty[1:], strict=False)]
    assert abs(statistics.fmean(gaps) - 0.1) < 0.02 and statistics.pstdev(gaps) > 0.15  # CV 2 vs Poisson's 1
    with pytest.raises(ValueError):
        arrival_times(3, 0.0, 1.0, 0)


def test_short_run_against_the_server(tmp_path: Path) -> None:
    s = Server("--offload", "neo", "--num-gpu-blocks", "24")
    try:
        out, png = tmp_path / "run.json", tmp_path / "run.png"
        args = [
            "--url",
            s.url,
            "--input-len",
            "48",
            "--output-len",
            "24",
            "--num-requests",
            "24",
            "--rate",
            "20,inf",
        ]
        bench_main(
            [
                *args,
                "--slo",
                "ttft:60000",
                "tpot:1000",
                "--label",
                "neo",
                "--out",
                str(out),
                "--plot",
                str(png),
            ]
        )
    finally:
        assert s.stop() == 0
    runs = json.loads(out.read_text())
    assert [r["rate"] for r in runs] == [20.0, float("inf")]
    for r in runs:
        m = r["summary"]
        reqs = m["requests"]
        assert m["completed"] == 24 and m["failed"] == 0
        assert m["total_output_tokens"] == sum(q["output_tokens"] for q in reqs)
        assert all(21 <= q["output_tokens"] <= 27 for q in reqs)  # 24 +- 10%
        assert all(0 < q["ttft_ms"] <= q["e2e_ms"] for q in reqs)
        assert m["ttft_ms"]["median"] <= m["e2e_ms"]["median"] and m["goodput"] == pytest.approx(
            m["request_throughput"]
        )
        assert m["output_throughput"] == pytest.approx(m["total_output_tokens"] / m["duration_s"])
        off = m["offload"]
        assert off is not None and 0 <= off["cpu_decode_share"] <= 1 and off["host_kv_blocks_max"] >= 0
        assert 0 <= off["prefix_cache_hit_rate"] <= 1
    assert runs[1]["summary"]["offload"]["cpu_decode_share"] > 0  # 24 requests overflow 24 device blocks
    assert png.stat().st_size > 10_000
