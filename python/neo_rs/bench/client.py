"""Send a workload to an OpenAI-compatible server as streaming completions and record each
request's timeline; scrape neo_rs's ``/metrics`` before, during and after the run."""

from __future__ import annotations

import asyncio
import json
import time
from dataclasses import dataclass, field
from typing import Any

import aiohttp

from neo_rs.bench.workloads import BenchRequest, prompt_ids


@dataclass
class RequestRecord:
    prompt_len: int
    ok: bool = False
    error: str = ""
    output_tokens: int = 0
    ttft: float = 0.0  # seconds from send to the first token
    e2e: float = 0.0
    itl: list[float] = field(default_factory=list)  # gaps between streamed chunks

    @property
    def tpot(self) -> float:
        """Time per output token after the first (vLLM's TPOT)."""
        return (self.e2e - self.ttft) / (self.output_tokens - 1) if self.output_tokens > 1 else 0.0


async def _one(
    s: aiohttp.ClientSession, url: str, model: str, req: BenchRequest, index: int, vocab: int
) -> RequestRecord:
    rec = RequestRecord(prompt_len=req.prompt_len)
    body: dict[str, Any] = {
        "model": model,
        "prompt": req.prompt if req.prompt is not None else prompt_ids(req, index, vocab),
        "max_tokens": req.output_len,
        "temperature": 0.0,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    start = last = time.perf_counter()
    try:
        async with s.post(url + "/v1/completions", json=body) as r:
            if r.status != 200:
                rec.error = f"HTTP {r.status}: {(await r.text())[:200]}"
                return rec
            async for line in r.content:
                if not line.startswith(b"data: {"):
                    continue
                payload = json.loads(line[6:])
                now = time.perf_counter()
                if payload.get("choices"):
                    if rec.ttft == 0.0:
                        rec.ttft = now - start
                    else:
                        rec.itl.append(now - last)
                    last = now
                usage = payload.get("usage")
                if usage:
                    rec.output_tokens = usage["completion_tokens"]
                    if req.prompt is not None:
                        rec.prompt_len = usage["prompt_tokens"]
        rec.e2e = time.perf_counter() - start
        rec.ok = rec.ttft > 0
        if not rec.ok:
            rec.error = "no tokens streamed"
    except (aiohttp.ClientError, asyncio.TimeoutError, ValueError) as e:
        rec.error = f"{type(e).__name__}: {e}"
    return rec


async def scrape(s: aiohttp.ClientSession, url: str) -> dict[str, float]:
    """neo_rs metric samples (name plus labels -> value); empty for servers without them."""
    try:
        async with s.get(url + "/metrics") as r:
            text = await r.text() if r.status == 200 else ""
    except aiohttp.ClientError:
        return {}
    out = {}
    for line in text.splitlines():
        if line.startswith("neo:"):
            key, _, value = line.rpartition(" ")
            out[key] = float(value)
    return out


@dataclass
class RunResult:
    records: list[RequestRecord]
    duration: float
    metrics_before: dict[str, float]
    metrics_after: dict[str, float]
    host_kv_samples: list[float]


async def run(
    url: str,
    model: str,
    requests: list[BenchRequest],
    arrivals: list[float],
    max_concurrency: int | None,
    vocab: int,
    warmup: int = 0,
) -> RunResult:
    timeout = aiohttp.ClientTimeout(total=None, sock_read=600)
    # A connection per request, as vLLM's client opens: llama.cpp's server closes kept-alive
    # connections under load, and a request written into one that it closed fails.
    connector = aiohttp.TCPConnector(limit=0, force_close=True)
    async with aiohttp.ClientSession(connector=connector, timeout=timeout) as s:
        for i in range(warmup):  # not measured
            await _one(s, url, model, BenchRequest(16, 4), -1 - i, vocab)
        before = await scrape(s, url)
        gate = asyncio.Semaphore(max_concurrency) if max_concurrency else None
        kv: list[float] = []
        start = time.perf_counter()

        async def fire(i: int, req: BenchRequest) -> RequestRecord:
            await asyncio.sleep(max(0.0, start + arrivals[i] - time.perf_counter()))
            if gate is None:
                return await _one(s, url, model, req, i, vocab)
            async with gate:
                return await _one(s, url, model, req, i, vocab)

        async def sample_kv(done: asyncio.Event) -> None:
            while not done.is_set():
                m = await scrape(s, url)
                if m:
                    kv.append(
                        sum(
                            v
                            for k, v in m.items()
                            if k.startswith("neo:kv_blocks_used") and 'pool="cpu"' in k
                        )
                    )
                try:
                    await asyncio.wait_for(done.wait(), 0.5)
                except asyncio.TimeoutError:
                    pass

        done = asyncio.Event()
        sampler = asyncio.create_task(sample_kv(done))
        records = await asyncio.gather(*(fire(i, r) for i, r in enumerate(requests)))
        duration = time.perf_counter() - start
        done.set()
        await sampler
        after = await scrape(s, url)
    return RunResult(list(records), duration, before, after, kv)
