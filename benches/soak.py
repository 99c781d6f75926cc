"""Soak: nothing leaks, nothing drifts. A server on the demo model with ``--offload neo``, a tiny
device pool and a host tier (so swaps, CPU decodes and tier copies run all the time), loaded for
``--minutes`` by concurrent clients drawing from a mix: streaming and whole completions and chats,
clients that hang up at a random point, ``n > 1``, structured outputs, tool calls, prompts that
share a prefix, and bad requests. Every ``--interval`` s it samples /metrics, the server's RSS and
its open file descriptors. At the end, with the server idle, it asserts:

- 0 KV blocks in use in both pools;
- the RSS slope over the run's second half under 1 MB/min (in runs of ``DRIFT_MINUTES`` or more);
- as many open file descriptors as at the start;
- every request that was neither hung up nor bad completed (200, a finish reason);
- p99 inter-token latency in the last quarter within 1.2x that of the second quarter (likewise);
- CPU decodes and swaps happened (the offload paths ran).

    python benches/soak.py                 # 20 minutes
    python benches/soak.py --minutes 2     # make test's run (tests/python/test_soak.py): the RSS
                                           # slope and latency drift need DRIFT_MINUTES or more
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

import aiohttp

MODEL = "neo-rs-demo"
SYSTEM = "You are a careful assistant. Answer in one short sentence, and never use more words than needed. "
SCHEMA = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"]}
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "lookup",
            "parameters": {"type": "object", "properties": {"q": {"type": "string"}}, "required": ["q"]},
        },
    }
]
KINDS = ["stream", "whole", "chat", "hang_up", "n", "json", "tools", "bad"]


@dataclass
class Tally:
    sent: dict[str, int] = field(default_factory=dict)
    completed: dict[str, int] = field(default_factory=dict)
    failures: list[str] = field(default_factory=list)
    itl: list[tuple[float, float]] = field(default_factory=list)  # (when, seconds between events)

    def count(self, kind: str, done: bool, why: str = "") -> None:
        self.sent[kind] = self.sent.get(kind, 0) + 1
        if done:
            self.completed[kind] = self.completed.get(kind, 0) + 1
        elif kind not in ("hang_up", "bad"):
            self.failures.append(f"{kind}: {why}")


def _body(kind: str, rng: random.Random) -> tuple[str, dict]:
    prompt = SYSTEM + " ".join(f"w{rng.randrange(1000)}" for _ in range(rng.randrange(2, 12)))
    tokens = rng.randrange(4, 40)
    chat = {"model": MODEL, "messages": [{"role": "user", "content": prompt}], "max_tokens": tokens}
    if kind == "chat":
        return "/v1/chat/completions", chat
    if kind == "json":
        fmt = {"type": "json_schema", "json_schema": {"name": "r", "schema": SCHEMA}}
        return "/v1/chat/completions", {**chat, "response_format": fmt, "max_tokens": 60}
    if kind == "tools":
        return "/v1/chat/completions", {**chat, "tools": TOOLS, "tool_choice": "required", "max_tokens": 60}
    body = {"model": MODEL, "prompt": prompt, "max_tokens": tokens, "ignore_eos": True}
    if kind == "n":
        return "/v1/completions", {**body, "n": 3, "temperature": 0.8}
    if kind in ("stream", "hang_up"):
        return "/v1/completions", {**body, "stream": True, "max_tokens": 64}
    if kind == "bad":
        return "/v1/completions", rng.choice(
            [{**body, "n": 0}, {**body, "max_tokens": 10**7}, {"prompt": []}]
        )
    return "/v1/completions", body


async def one(s: aiohttp.ClientSession, url: str, kind: str, rng: random.Random, tally: Tally) -> None:
    path, body = _body(kind, rng)
    async with s.post(url + path, json=body) as r:
        if kind == "bad":
            await r.read()
            tally.count(kind, r.status == 400)
            if r.status != 400:
                tally.failures.append(f"bad request answered {r.status}")
            return
        if r.status != 200:
            tally.count(kind, False, f"status {r.status}: {(await r.read())[:200]!r}")
            return
        if not body.get("stream"):
            choices = (await r.json())["choices"]
            done = all(c["finish_reason"] for c in choices)
            tally.count(kind, done, "no finish reason")
            return
        stop_after = rng.randrange(1, 30) if kind == "hang_up" else None
        events, last, finished = 0, time.monotonic(), False
        async for line in r.content:
            if not line.startswith(b"data: {"):
                continue
            now = time.monotonic()
            if events:
                tally.itl.append((now, now - last))
            last, events = now, events + 1
            finished |= any(c.get("finish_reason") for c in json.loads(line[6:]).get("choices", []))
            if stop_after is not None and events >= stop_after:
                r.close()  # hang up mid-stream
                break
        tally.count(kind, finished or kind == "hang_up", "the stream ended without a finish reason")


async def load(url: str, end: float, tally: Tally, clients: int, seed: int) -> None:
    async def client(i: int) -> None:
        rng = random.Random(seed * 1000 + i)
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=120)) as s:
            while time.monotonic() < end:
                try:
                    await one(s, url, rng.choice(KINDS), rng, tally)
                except (aiohttp.ClientError, asyncio.TimeoutError) as e:
                    tally.failures.append(f"client error: {e!r}")

    await asyncio.gather(*(client(i) for i in range(clients)))


# Gauges the soak follows, and counters that show the offload paths ran.
_SAMPLED = (
    "neo:kv_blocks_used",
    "neo:num_requests_",
    "neo:cpu_decode_requests_total",
    "neo:swapped_blocks_total",
    "neo:prefix_cache_copied_blocks_total",
)
# The drift checks (RSS slope, latency quarters) need a run this long: in shorter ones a single
# step of the allocator's arenas (a few MB at once) or one busy quarter-minute decides them.
DRIFT_MINUTES = 10.0


def metrics(url: str) -> dict[str, float]:
    with urllib.request.urlopen(url + "/metrics", timeout=10) as r:
        text = r.read().decode()
    out: dict[str, float] = {}
    for line in text.splitlines():
        if line.startswith(_SAMPLED):
            name, value = line.rsplit(" ", 1)
            out[name] = float(value)
    return out


def process_sample(pid: int) -> tuple[float, int]:
    """RSS in MB and open file descriptors of process ``pid``."""
    rss_kb = next(
        int(line.split()[1])
        for line in Path(f"/proc/{pid}/status").read_text().splitlines()
        if line.startswith("VmRSS")
    )
    return rss_kb / 1024, len(os.listdir(f"/proc/{pid}/fd"))


def settled_fds(pid: int) -> int:
    """The server's open file descriptors once the count holds still for a second (sockets of
    clients that just left close a moment after them)."""
    last = -1
    for _ in range(20):
        now = process_sample(pid)[1]
        if now == last:
            return now
        last = now
        time.sleep(1.0)
    return last


def slope_mb_per_min(points: list[tuple[float, float]]) -> float:
    """Least-squares slope of (seconds, MB) points, in MB per minute."""
    if len(points) < 2:
        return 0.0
    ts, ys = [p[0] for p in points], [p[1] for p in points]
    mt, my = statistics.fmean(ts), statistics.fmean(ys)
    var = sum((t - mt) ** 2 for t in ts)
    return 60 * sum((t - mt) * (y - my) for t, y in zip(ts, ys, strict=True)) / var if var else 0.0


def p99(xs: list[float]) -> float:
    return sorted(xs)[min(len(xs) - 1, int(0.99 * len(xs)))] if xs else float("nan")


def wait_idle(url: str, timeout: float = 120) -> dict[str, float]:
    deadline = time.monotonic() + timeout
    while True:
        m = metrics(url)
        running = sum(v for k, v in m.items() if k.startswith("neo:num_requests_"))
        if running == 0 or time.monotonic() > deadline:
            return m
        time.sleep(0.5)


def soak(minutes: float, interval: float, clients: int, seed: int, port: int) -> dict:
    url = f"http://127.0.0.1:{port}"
    cmd = [sys.executable, "-m", "neo_rs.serve", "--model", "demo", "--port", str(port), "--offload", "neo",
           "--num-gpu-blocks", "96", "--cpu-kv-gib", "0.02", "--block-size", "8", "--max-num-seqs", "32",
           "--log-level", "warning"]  # fmt: skip
    log = tempfile.NamedTemporaryFile("w+", prefix="soak-server-", suffix=".log", delete=False)  # noqa: SIM115
    server = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 180
        while True:
            try:
                with urllib.request.urlopen(url + "/health", timeout=1) as r:
                    if r.status == 200:
                        break
            except OSError:
                if server.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError(
                        f"the server did not start: {Path(log.name).read_text()[-2000:]}"
                    ) from None
            time.sleep(0.5)
        # Warm-up, unmeasured: every kind of request twice, so that what the server builds once
        # (grammar and tokenizer caches, worker threads, the profile) is there before the baseline.
        warm = Tally()

        async def warm_up() -> None:
            async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=120)) as s:
                for i, kind in enumerate(KINDS * 2):
                    await one(s, url, kind, random.Random(i), warm)

        asyncio.run(warm_up())
        wait_idle(url)
        fds_start = settled_fds(server.pid)
        tally, samples = Tally(), []
        start = time.monotonic()
        end = start + minutes * 60

        async def run() -> None:
            task = asyncio.create_task(load(url, end, tally, clients, seed))
            while not task.done():
                rss, fds = process_sample(server.pid)
                samples.append((time.monotonic() - start, rss, fds))
                await asyncio.sleep(interval)
            await task

        asyncio.run(run())
        idle = wait_idle(url)
        fds_end = settled_fds(server.pid)
    finally:
        server.terminate()
        server.wait(60)
    half = [(t, rss) for t, rss, _ in samples if t >= minutes * 30]
    q = minutes * 60 / 4
    second = [d for t, d in tally.itl if q <= t - start < 2 * q]
    last = [d for t, d in tally.itl if t - start >= 3 * q]
    return {
        "minutes": minutes,
        "requests": tally.sent,
        "completed": tally.completed,
        "failures": tally.failures[:20],
        "blocks_in_use_idle": {k: v for k, v in idle.items() if k.startswith("neo:kv_blocks_used")},
        "offload": {k: v for k, v in idle.items() if "_total" in k},
        "rss_mb": [round(rss, 1) for _, rss, _ in samples],
        "rss_slope_mb_per_min": slope_mb_per_min(half),
        "fds": [fds_start, fds_end],
        "p99_itl_ms": [p99(second) * 1e3, p99(last) * 1e3],
    }


def verdicts(r: dict) -> list[str]:
    """What the soak asserts, each as a failed check's description (empty: all passed). The drift
    checks only from ``DRIFT_MINUTES`` on (``main`` says when they were left out)."""
    out = []
    if any(v for v in r["blocks_in_use_idle"].values()):
        out.append(f"KV blocks in use at idle: {r['blocks_in_use_idle']}")
    if r["fds"][1] != r["fds"][0]:
        out.append(f"open file descriptors {r['fds'][0]} at the start, {r['fds'][1]} at the end")
    if r["failures"]:
        out.append(f"{len(r['failures'])}+ requests did not complete: {r['failures'][:3]}")
    ran = ("neo:cpu_decode_requests_total", "neo:swapped_blocks_total")
    if not all(any(k.startswith(name) and v > 0 for k, v in r["offload"].items()) for name in ran):
        out.append(f"the offload paths did not all run: {r['offload']}")
    if r["minutes"] < DRIFT_MINUTES:
        return out
    if r["rss_slope_mb_per_min"] >= 1.0:
        out.append(f"RSS grows {r['rss_slope_mb_per_min']:.2f} MB/min over the second half")
    second, last = r["p99_itl_ms"]
    if not last <= 1.2 * second:
        out.append(
            f"p99 inter-token latency {last:.1f} ms in the last quarter, {second:.1f} ms in the second"
        )
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--minutes", type=float, default=20.0)
    ap.add_argument("--interval", type=float, default=10.0, help="seconds between samples")
    ap.add_argument("--clients", type=int, default=8)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--port", type=int, default=8797)
    args = ap.parse_args()
    r = soak(args.minutes, args.interval, args.clients, args.seed, args.port)
    print(json.dumps(r, indent=1))
    if r["minutes"] < DRIFT_MINUTES:
        print(f"RSS slope and latency drift are checked from {DRIFT_MINUTES:g} minutes on (shown above)")
    failed = verdicts(r)
    for line in failed:
        print("FAILED:", line)
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
