"""Summaries of a run (vLLM's serving-benchmark figures plus NEO's per-token latency and the
offload tier's figures), the table, the JSON file and the plots."""

from __future__ import annotations

import json
import statistics
from pathlib import Path
from typing import Any

from neo_rs.bench.client import RunResult


def _stats(xs: list[float], scale: float = 1e3) -> dict[str, float]:
    if not xs:
        return {"mean": 0.0, "median": 0.0, "p99": 0.0}
    s = sorted(xs)
    return {
        "mean": statistics.fmean(s) * scale,
        "median": statistics.median(s) * scale,
        "p99": s[min(len(s) - 1, int(0.99 * len(s)))] * scale,
    }


def _delta(r: RunResult, prefix: str, must: str = "") -> float:
    return sum(
        v - r.metrics_before.get(k, 0.0)
        for k, v in r.metrics_after.items()
        if k.startswith(prefix) and must in k
    )


def offload_figures(r: RunResult) -> dict[str, float] | None:
    """What neo_rs's offload tier did during the run (None for other servers)."""
    if not r.metrics_after:
        return None
    tokens = _delta(r, "neo:generation_tokens_total")
    iterations = _delta(r, "neo:iterations_total")
    queries = _delta(r, "neo:prefix_cache_queries_total")
    return {
        "prefix_cache_hit_rate": _delta(r, "neo:prefix_cache_hits_total") / queries if queries else 0.0,
        "prefix_cache_host_hit_rate": _delta(r, "neo:prefix_cache_hits_total", 'tier="host"') / queries
        if queries
        else 0.0,
        "cpu_decode_share": _delta(r, "neo:cpu_decode_requests_total") / tokens if tokens else 0.0,
        "pipelined_iteration_share": _delta(r, "neo:iterations_total", 'mode="pipelined"') / iterations
        if iterations
        else 0.0,
        "cpu_attention_ms_per_iteration": _delta(r, "neo:cpu_attention_seconds_total") * 1e3 / iterations
        if iterations
        else 0.0,
        "host_device_bytes_per_s": _delta(r, "neo:host_device_bytes_total") / r.duration,
        "host_kv_blocks_mean": statistics.fmean(r.host_kv_samples) if r.host_kv_samples else 0.0,
        "host_kv_blocks_max": max(r.host_kv_samples, default=0.0),
    }


def summarize(r: RunResult, slo_ttft_ms: float | None, slo_tpot_ms: float | None) -> dict[str, Any]:
    ok = [x for x in r.records if x.ok]
    out_tokens = sum(x.output_tokens for x in ok)
    in_tokens = sum(x.prompt_len for x in ok)

    def meets(x: Any) -> bool:
        return (slo_ttft_ms is None or x.ttft * 1e3 <= slo_ttft_ms) and (
            slo_tpot_ms is None or x.tpot * 1e3 <= slo_tpot_ms
        )

    return {
        "completed": len(ok),
        "failed": len(r.records) - len(ok),
        "errors": sorted({x.error for x in r.records if not x.ok})[:5],
        "duration_s": r.duration,
        "request_throughput": len(ok) / r.duration,
        "output_throughput": out_tokens / r.duration,
        "total_token_throughput": (out_tokens + in_tokens) / r.duration,
        "total_output_tokens": out_tokens,
        "total_input_tokens": in_tokens,
        "goodput": sum(1 for x in ok if meets(x)) / r.duration,
        "ttft_ms": _stats([x.ttft for x in ok]),
        "tpot_ms": _stats([x.tpot for x in ok if x.output_tokens > 1]),
        "itl_ms": _stats([g for x in ok for g in x.itl]),
        "e2e_ms": _stats([x.e2e for x in ok]),
        "per_token_latency_ms": _stats([x.e2e / x.output_tokens for x in ok if x.output_tokens]),
        "offload": offload_figures(r),
        "requests": [
            {
                "prompt_len": x.prompt_len,
                "output_tokens": x.output_tokens,
                "ttft_ms": x.ttft * 1e3,
                "e2e_ms": x.e2e * 1e3,
            }
            for x in r.records
        ],
    }


def table(label: str, rate: float, s: dict[str, Any]) -> str:
    lines = [
        f"== {label} @ {rate} req/s: {s['completed']} completed, {s['failed']} failed "
        f"in {s['duration_s']:.1f} s",
        f"  throughput  {s['request_throughput']:.2f} req/s, {s['output_throughput']:.1f} output tok/s, "
        f"{s['total_token_throughput']:.1f} total tok/s, goodput {s['goodput']:.2f} req/s",
        f"  {'(ms)':<18}{'mean':>10}{'median':>10}{'p99':>10}",
    ]
    for key, name in (
        ("ttft_ms", "TTFT"),
        ("tpot_ms", "TPOT"),
        ("itl_ms", "ITL"),
        ("e2e_ms", "end-to-end"),
        ("per_token_latency_ms", "per-token latency"),
    ):
        st = s[key]
        lines.append(f"  {name:<18}{st['mean']:>10.1f}{st['median']:>10.1f}{st['p99']:>10.1f}")
    off = s["offload"]
    if off:
        lines.append(
            f"  offload: CPU decodes {off['cpu_decode_share']:.0%} of tokens, "
            f"pipelined iterations {off['pipelined_iteration_share']:.0%}, "
            f"CPU attention {off['cpu_attention_ms_per_iteration']:.2f} ms/iter, "
            f"host<->device {off['host_device_bytes_per_s'] / 1e6:.1f} MB/s, "
            f"host KV blocks mean {off['host_kv_blocks_mean']:.0f} max {off['host_kv_blocks_max']:.0f}"
        )
        lines.append(
            f"  prefix cache: {off['prefix_cache_hit_rate']:.0%} of prompt tokens hit "
            f"({off['prefix_cache_host_hit_rate']:.0%} in the host tier)"
        )
    if s["errors"]:
        lines.append(f"  errors: {s['errors']}")
    return "\n".join(lines)


def write_json(path: Path, runs: list[dict[str, Any]]) -> None:
    path.write_text(json.dumps(runs, indent=1))


def plot(path: Path, runs: list[dict[str, Any]]) -> None:
    """Load-latency curves (per-token latency and TTFT vs request rate, one line per label) and
    output throughput of every run side by side."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(15, 4.2))
    labels = sorted({r["label"] for r in runs})
    for label in labels:
        pts = sorted(
            (r["rate"], r["summary"]) for r in runs if r["label"] == label and r["rate"] != float("inf")
        )
        if pts:
            rates = [p[0] for p in pts]
            axes[0].plot(rates, [p[1]["per_token_latency_ms"]["mean"] for p in pts], marker="o", label=label)
            axes[1].plot(rates, [p[1]["ttft_ms"]["median"] for p in pts], marker="o", label=label)
    axes[0].set(xlabel="request rate (req/s)", ylabel="per-token latency (ms, mean)", title="Load vs latency")
    axes[1].set(xlabel="request rate (req/s)", ylabel="TTFT (ms, median)", title="Load vs TTFT")
    names = [f"{r['label']}\n@{r['rate']:g}" for r in runs]
    axes[2].bar(names, [r["summary"]["output_throughput"] for r in runs], color="tab:blue")
    axes[2].set(ylabel="output tokens/s", title="Throughput")
    axes[2].tick_params(axis="x", labelsize=7)
    for ax in axes[:2]:
        if ax.lines:
            ax.legend()
        ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
