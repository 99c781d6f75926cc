"""Prometheus metrics (``neo:`` prefix, vLLM's names where they exist): request outcomes,
token counters, latency histograms, queue and pool gauges, and the offload tier (iterations by
mode, CPU-decode requests, CPU attention seconds, host<->device bytes, swaps), and speculative
decoding's drafts and acceptance."""

from __future__ import annotations

import time

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from neo_rs.engine.llm_engine import LLMEngine
from neo_rs.engine.sequence import RequestOutput
from neo_rs.engine.stats import IterationStats

_LATENCY = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120)


class Metrics:
    def __init__(self, model_name: str) -> None:
        self.registry = r = CollectorRegistry()
        label = ["model_name"]
        self.model = model_name
        self.requests = Counter(
            "neo:request_success", "Finished requests.", [*label, "finished_reason"], registry=r
        )
        self.prompt_tokens = Counter("neo:prompt_tokens", "Prompt tokens processed.", label, registry=r)
        self.generation_tokens = Counter("neo:generation_tokens", "Tokens generated.", label, registry=r)
        self.ttft = Histogram(
            "neo:time_to_first_token_seconds", "Time to first token.", label, buckets=_LATENCY, registry=r
        )
        self.itl = Histogram(
            "neo:inter_token_latency_seconds", "Time between tokens.", label, buckets=_LATENCY, registry=r
        )
        self.e2e = Histogram(
            "neo:e2e_request_latency_seconds", "Request latency.", label, buckets=_LATENCY, registry=r
        )
        self.queue = Histogram(
            "neo:request_queue_time_seconds",
            "Arrival to first token scheduled.",
            label,
            buckets=_LATENCY,
            registry=r,
        )
        self.running = Gauge("neo:num_requests_running", "Requests in the running set.", label, registry=r)
        self.waiting = Gauge("neo:num_requests_waiting", "Requests waiting.", label, registry=r)
        self.kv_usage = Gauge(
            "neo:kv_cache_usage_perc", "Share of KV blocks in use.", [*label, "pool"], registry=r
        )
        self.kv_used = Gauge("neo:kv_blocks_used", "KV blocks in use.", [*label, "pool"], registry=r)
        self.cpu_kv_width = Gauge(
            "neo:cpu_kv_bytes_per_token",
            "Bytes of K and V per token and layer in the host pool (what CPU attention reads).",
            label,
            registry=r,
        )
        self.swapped = Counter(
            "neo:swapped_blocks", "Blocks moved between pools.", [*label, "direction"], registry=r
        )
        self.preemptions = Counter("neo:num_preemptions", "Recompute preemptions.", label, registry=r)
        self.iterations = Counter(
            "neo:iterations", "Engine iterations by mode.", [*label, "mode"], registry=r
        )
        self.cpu_decodes = Counter(
            "neo:cpu_decode_requests", "Decodes whose attention ran on the CPU.", label, registry=r
        )
        self.cpu_attn = Counter("neo:cpu_attention_seconds", "CPU attention kernel time.", label, registry=r)
        self.transfer = Counter(
            "neo:host_device_bytes", "Bytes of CPU decodes between device and host.", label, registry=r
        )
        self.prefix_queries = Counter(
            "neo:prefix_cache_queries", "Prompt tokens looked up in the prefix cache.", label, registry=r
        )
        self.prefix_hits = Counter(
            "neo:prefix_cache_hits",
            "Prompt tokens whose KV the prefix cache held.",
            [*label, "tier"],
            registry=r,
        )
        self.prefix_blocks = Gauge(
            "neo:prefix_cache_blocks",
            "Blocks registered in the prefix cache (held by requests or evictable).",
            [*label, "tier"],
            registry=r,
        )
        self.prefix_copies = Counter(
            "neo:prefix_cache_copied_blocks",
            "Prefix blocks copied between the tiers: evicted from the device into the host tier "
            "(to_host), host-tier hits into the device (to_device).",
            [*label, "direction"],
            registry=r,
        )
        self.spec_drafts = Counter(
            "neo:spec_decode_num_drafts", "Decodes that verified drafts.", label, registry=r
        )
        self.spec_draft_tokens = Counter(
            "neo:spec_decode_draft_tokens", "Draft tokens verified.", label, registry=r
        )
        self.spec_accepted_tokens = Counter(
            "neo:spec_decode_accepted_tokens", "Draft tokens accepted.", label, registry=r
        )
        self.spec_accepted_per_pos = Counter(
            "neo:spec_decode_num_accepted_tokens_per_pos",
            "Drafts accepted at each position (0: the first draft).",
            [*label, "position"],
            registry=r,
        )
        self._prefix_seen: dict[str, int] = {}  # scheduler totals already counted
        self._last_token: dict[str, float] = {}  # engine thread only

    def on_step(self, engine: LLMEngine, stats: IterationStats | None, outputs: list[RequestOutput]) -> None:
        """Called by the engine thread after every iteration."""
        m = self.model
        sched = engine.scheduler
        self.running.labels(m).set(sched.num_running)
        self.waiting.labels(m).set(sched.num_waiting + sched.num_swapped)
        self.cpu_kv_width.labels(m).set(engine.runner.cpu_kv_bytes_per_token())
        totals = sched.stats()
        prefix_counters = {
            "prefix_cache_queries": self.prefix_queries.labels(m),
            "prefix_cache_hits": self.prefix_hits.labels(m, "device"),
            "prefix_cache_host_hits": self.prefix_hits.labels(m, "host"),
            "num_cache_blocks_to_host": self.prefix_copies.labels(m, "to_host"),
            "num_cache_blocks_to_device": self.prefix_copies.labels(m, "to_device"),
        }
        for key, counter in prefix_counters.items():
            counter.inc(totals[key] - self._prefix_seen.get(key, 0))
            self._prefix_seen[key] = totals[key]
        for tier, pool in (("device", "gpu"), ("host", "cpu")):
            self.prefix_blocks.labels(m, tier).set(sched.num_cached_blocks(pool))
        for pool in ("gpu", "cpu"):
            total = sched.num_total_blocks(pool)
            used = total - sched.num_free_blocks(pool)
            self.kv_used.labels(m, pool).set(used)
            self.kv_usage.labels(m, pool).set(used / total if total else 0.0)
        if stats is not None:
            self.iterations.labels(m, stats.mode).inc()
            self.swapped.labels(m, "out").inc(stats.num_swapped_out_blocks + stats.num_prefill_to_host_blocks)
            self.swapped.labels(m, "in").inc(stats.num_swapped_in_blocks)
            self.preemptions.labels(m).inc(stats.num_recomputed)
            self.cpu_decodes.labels(m).inc(stats.num_cpu_decodes)
            self.cpu_attn.labels(m).inc(stats.cpu_attn_ms / 1e3)
            self.transfer.labels(m).inc(stats.transfer_bytes)
            self.spec_drafts.labels(m).inc(stats.num_drafts)
            self.spec_draft_tokens.labels(m).inc(stats.num_draft_tokens)
            self.spec_accepted_tokens.labels(m).inc(sum(stats.accepted_per_position))
            for pos, n in enumerate(stats.accepted_per_position):
                self.spec_accepted_per_pos.labels(m, str(pos)).inc(n)
        now = time.monotonic()
        for out in outputs:
            last = self._last_token.get(out.request_id)
            if last is not None:
                self.itl.labels(m).observe(now - last)
            if out.finished:
                self._last_token.pop(out.request_id, None)
                self.finished(out)
            else:
                self._last_token[out.request_id] = now

    def finished(self, out: RequestOutput) -> None:
        m, t = self.model, out.metrics
        for o in out.outputs:
            self.requests.labels(m, o.finish_reason or "abort").inc()
        self.prompt_tokens.labels(m).inc(len(out.prompt_token_ids))
        # From the request's metrics: a DELTA output holds only its last tokens.
        self.generation_tokens.labels(m).inc(t.num_generation_tokens)
        if t.first_token_time is not None:
            self.ttft.labels(m).observe(t.first_token_time - t.arrival_time)
        if t.first_scheduled_time is not None:
            self.queue.labels(m).observe(t.first_scheduled_time - t.arrival_time)
        if t.finished_time is not None:
            self.e2e.labels(m).observe(t.finished_time - t.arrival_time)

    def render(self) -> bytes:
        return generate_latest(self.registry)
