"""Whether a stream's cost grows with its length: one streaming completion of 4,000 tokens
through ``python -m neo_rs.serve``, the mean inter-token latency over tokens 100-200 and over tokens
3,900-4,000, and their ratio (the goal: at most 1.2x). The forward pass itself grows with the
context (attention reads every earlier token), so the same stream is also run in-process, splitting
each step into the model's forward and everything else (scheduling, sampling, detokenizing, building
outputs): that second part is what must not grow.

The model is the demo model (random weights), which the goal is stated for; ``--model
smollm2-135m-instruct`` streams from real weights, whose 30 layers of attention over 4,000 tokens
add 30-45% to the forward on a CPU.

    python benches/stream_cost.py [--tokens 4000] [--model smollm2-135m-instruct]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time
from pathlib import Path

import aiohttp
from neo_rs import LLMEngine, RequestOutputKind, SamplingParams
from neo_rs.config import EngineArgs

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests" / "python"))
from server_util import Server  # noqa: E402


async def stream(url: str, tokens: int) -> list[tuple[float, int]]:
    """(arrival time, tokens so far) per SSE event."""
    body = {
        "prompt": "Once upon a time",
        "max_tokens": tokens,
        "ignore_eos": True,
        "temperature": 0,
        "logprobs": 0,  # an event for every token, even one that completes no character
        "stream": True,
        "stream_options": {"include_usage": True, "continuous_usage_stats": True},
    }
    marks = []
    timeout = aiohttp.ClientTimeout(total=1800)
    async with aiohttp.ClientSession(timeout=timeout) as s, s.post(url + "/v1/completions", json=body) as r:
        async for line in r.content:
            if line.startswith(b"data: {"):
                usage = json.loads(line[6:]).get("usage")
                if usage:
                    marks.append((time.perf_counter(), usage["completion_tokens"]))
    return marks


def mean_itl_ms(marks: list[tuple[float, int]], lo: int, hi: int) -> float:
    """Mean time per token from the last event at or before ``lo`` tokens to the first at or
    after ``hi``."""
    start = max((m for m in marks if m[1] <= lo), key=lambda m: m[1], default=marks[0])
    end = next(m for m in marks if m[1] >= hi)
    return (end[0] - start[0]) / (end[1] - start[1]) * 1e3


def engine_split(model: str, tokens: int) -> tuple[list[float], list[float]]:
    """Per step of one DELTA stream in-process: (whole step, model forward), in ms."""
    engine = LLMEngine(EngineArgs(model=model))
    params = SamplingParams(
        temperature=0, max_tokens=tokens, ignore_eos=True, logprobs=0, output_kind=RequestOutputKind.DELTA
    )
    engine.add_request("Once upon a time", params)
    steps: list[float] = []
    forwards: list[float] = []
    execute = engine.runner.execute

    def timed(plan):  # noqa: ANN001, ANN202
        t = time.perf_counter()
        out = execute(plan)
        forwards.append((time.perf_counter() - t) * 1e3)
        return out

    engine.runner.execute = timed  # type: ignore[method-assign]
    while engine.has_unfinished():
        t = time.perf_counter()
        engine.step()
        steps.append((time.perf_counter() - t) * 1e3)
    return steps, forwards


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tokens", type=int, default=4000)
    ap.add_argument("--model", default="demo")
    args = ap.parse_args()
    server = Server("--log-level", "warning", model=args.model)
    try:
        marks = asyncio.run(stream(server.url, args.tokens))
    finally:
        server.stop()
    n = args.tokens
    early, late = mean_itl_ms(marks, 100, 200), mean_itl_ms(marks, n - 100, n)
    print(f"one stream of {marks[-1][1]} tokens, {args.model}")
    print(f"mean ITL, tokens 100-200:       {early:.2f} ms")
    print(f"mean ITL, tokens {n - 100}-{n}: {late:.2f} ms")
    print(f"late / early: {late / early:.2f}x (goal: at most 1.2x)")
    steps, forwards = engine_split(args.model, n)
    rest = [s - f for s, f in zip(steps, forwards, strict=True)]

    def mean(xs: list[float], lo: int, hi: int) -> float:
        return sum(xs[lo:hi]) / (hi - lo)

    print(f"in-process, ms per step   {'100-200':>9} {f'{n - 100}-{n}':>10}  late/early")
    for name, xs in (("model forward", forwards), ("everything else", rest)):
        a, b = mean(xs, 100, 200), mean(xs, n - 100, n)
        print(f"{name:<25} {a:>9.2f} {b:>10.2f}  {b / a:>9.2f}x")


if __name__ == "__main__":
    main()
