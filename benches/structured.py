"""The cost of structured outputs under load: 64 concurrent streams against ``make serve``'s
server (SmolLM2-135M-Instruct), with no constraint, then with half of them constrained by a JSON
Schema, alternating in one server process. The schema asks for more tokens than ``max_tokens``,
so every stream runs its full length in both runs and the batches match.

It prints mean inter-token latency (gaps between streamed chunks) and mean TPOT of all streams, of
the free ones and of the constrained ones, and the ratio of each run to the unconstrained one.
Every constrained output is checked to be a prefix the schema's grammar allows (it is cut by
``max_tokens``), and a second pass with a larger ``max_tokens`` checks a few complete outputs
against the schema.

    python benches/structured.py [--streams 64] [--tokens 128] [--rounds 2]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import subprocess
import sys
import time
import urllib.request
from typing import Any

import aiohttp

MODEL = "smollm2-135m-instruct"
PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 12},
        "age": {"type": "integer", "minimum": 0, "maximum": 99},
        "city": {"enum": ["Paris", "Lima", "Osaka", "Cairo", "Oslo"]},
        "email": {"type": "string", "maxLength": 24},
    },
    "required": ["name", "age", "city", "email"],
    "additionalProperties": False,
}
SCHEMA = {"type": "array", "items": PERSON, "minItems": 16, "maxItems": 16}


def start_server(port: int, streams: int) -> subprocess.Popen[bytes]:
    cmd = [sys.executable, "-m", "neo_rs.serve", "--port", str(port), "--max-num-seqs", str(streams)]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=1) as r:
                if r.status == 200:
                    return proc
        except OSError:
            time.sleep(0.5)
    proc.kill()
    raise RuntimeError("the server did not become ready")


async def one(s: aiohttp.ClientSession, url: str, i: int, tokens: int, constrained: bool) -> dict[str, Any]:
    body: dict[str, Any] = {
        "model": MODEL,
        "messages": [{"role": "user", "content": f"List sixteen people (#{i}) with name, age, city, email."}],
        "max_tokens": tokens,
        "temperature": 0,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    if constrained:
        body["response_format"] = {"type": "json_schema", "json_schema": {"name": "people", "schema": SCHEMA}}
    else:
        body["ignore_eos"] = True
    start = time.perf_counter()
    stamps: list[float] = []
    text, used = "", 0
    async with s.post(url + "/v1/chat/completions", json=body) as r:
        assert r.status == 200, await r.text()
        async for line in r.content:
            if not line.startswith(b"data: {"):
                continue
            payload = json.loads(line[6:])
            if payload.get("usage"):
                used = payload["usage"]["completion_tokens"]
            for c in payload["choices"]:
                if c["delta"].get("content"):
                    stamps.append(time.perf_counter())
                    text += c["delta"]["content"]
    gaps = [b - a for a, b in zip(stamps, stamps[1:], strict=False)]
    tpot = (stamps[-1] - stamps[0]) / (used - 1) if used > 1 else 0.0
    return {"constrained": constrained, "gaps": gaps, "tpot": tpot, "tokens": used, "text": text, "t": start}


async def run(url: str, streams: int, tokens: int, constrained: int) -> list[dict[str, Any]]:
    conn = aiohttp.TCPConnector(limit=streams)
    async with aiohttp.ClientSession(connector=conn, timeout=aiohttp.ClientTimeout(total=1800)) as s:
        return await asyncio.gather(
            *(one(s, url, i, tokens, i % 2 == 1 and i < 2 * constrained) for i in range(streams))
        )


def figures(recs: list[dict[str, Any]]) -> dict[str, float]:
    def mean_itl(rs: list[dict[str, Any]]) -> float:
        gaps = [g for r in rs for g in r["gaps"]]
        return statistics.fmean(gaps) * 1e3 if gaps else float("nan")

    def mean_tpot(rs: list[dict[str, Any]]) -> float:
        return statistics.fmean(r["tpot"] for r in rs) * 1e3 if rs else float("nan")

    free = [r for r in recs if not r["constrained"]]
    cons = [r for r in recs if r["constrained"]]
    return {
        "itl": mean_itl(recs),
        "tpot": mean_tpot(recs),
        "itl_free": mean_itl(free),
        "itl_constrained": mean_itl(cons),
        "tokens": sum(r["tokens"] for r in recs),
    }


def check_outputs(recs: list[dict[str, Any]], tokens: int) -> None:
    for r in recs:
        if r["constrained"]:
            assert r["text"].startswith("[{"), r["text"][:80]
            assert r["tokens"] == tokens, "a constrained stream ended early: the batches would differ"


async def complete_outputs(url: str) -> int:
    import jsonschema

    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=1800)) as s:
        body = {
            "model": MODEL,
            "messages": [{"role": "user", "content": "List sixteen people with name, age, city, email."}],
            "max_tokens": 2000,
            "temperature": 0.7,
            "n": 4,
            "response_format": {"type": "json_schema", "json_schema": {"name": "people", "schema": SCHEMA}},
        }
        async with s.post(url + "/v1/chat/completions", json=body) as r:
            choices = (await r.json())["choices"]
    for c in choices:
        jsonschema.validate(json.loads(c["message"]["content"]), SCHEMA)
    return len(choices)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--streams", type=int, default=64)
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--port", type=int, default=8131)
    args = ap.parse_args()
    proc = start_server(args.port, args.streams)
    url = f"http://127.0.0.1:{args.port}"
    try:
        asyncio.run(run(url, 4, 8, 2))  # warm-up, grammar cache included
        rows: dict[str, list[dict[str, float]]] = {"none": [], "half": []}
        for _ in range(args.rounds):
            for label, constrained in (("none", 0), ("half", args.streams // 2)):
                recs = asyncio.run(run(url, args.streams, args.tokens, constrained))
                check_outputs(recs, args.tokens)
                rows[label].append(figures(recs))
        checked = asyncio.run(complete_outputs(url))
    finally:
        proc.terminate()
        proc.wait(60)
    base = {k: statistics.median(f[k] for f in rows["none"]) for k in ("itl", "tpot")}
    print(f"\n{args.streams} streams x {args.tokens} tokens, {args.rounds} rounds each, medians of rounds")
    print(f"{'run':<30} {'ITL ms':>8} {'TPOT ms':>8} {'free ITL':>9} {'JSON ITL':>9} {'ITL/none':>9}")
    for label, name in (("none", "no constraints"), ("half", f"{args.streams // 2} JSON Schema streams")):
        med = {k: statistics.median(f[k] for f in rows[label]) for k in rows[label][0]}
        print(
            f"{name:<30} {med['itl']:>8.1f} {med['tpot']:>8.1f} {med['itl_free']:>9.1f} "
            f"{med['itl_constrained']:>9.1f} {med['itl'] / base['itl']:>8.3f}x"
        )
    print(f"complete outputs checked against the schema: {checked}")


if __name__ == "__main__":
    main()
