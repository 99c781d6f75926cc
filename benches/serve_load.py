"""Streaming load against an OpenAI-compatible server: N concurrent clients, each sending
streaming completions back to back for T seconds; prints requests/s, output tokens/s, TTFT and
inter-token latency (median, p99) per concurrency level.

    python benches/serve_load.py --url http://127.0.0.1:8000 --concurrency 1,16,64 --duration 20
    python benches/serve_load.py --spawn      # serve the ~20M-parameter random Llama here first
"""

from __future__ import annotations

import argparse
import asyncio
import json
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

import aiohttp


def pct(xs: list[float], q: float) -> float:
    return sorted(xs)[min(len(xs) - 1, int(q * len(xs)))] if xs else float("nan")


async def client(
    s: aiohttp.ClientSession, url: str, model: str, args: argparse.Namespace, end: float, out: dict
) -> None:
    prompt = " ".join(f"w{100 + i}" for i in range(args.prompt_len))
    body = {
        "model": model,
        "prompt": prompt,
        "max_tokens": args.max_tokens,
        "stream": True,
        "ignore_eos": True,
        "stream_options": {"include_usage": True},
    }
    while time.perf_counter() < end:
        t0 = time.perf_counter()
        last, first = t0, None
        async with s.post(url + "/v1/completions", json=body) as r:
            if r.status != 200:
                out["errors"] += 1
                await r.read()
                continue
            async for line in r.content:
                if not line.startswith(b"data: {"):
                    continue
                payload = json.loads(line[6:])
                now = time.perf_counter()
                if payload["choices"]:
                    if first is None:
                        first = now
                        out["ttft"].append(now - t0)
                    else:
                        out["itl"].append(now - last)
                    last = now
                elif payload.get("usage"):
                    out["tokens"] += payload["usage"]["completion_tokens"]
        out["requests"] += 1


async def level(url: str, model: str, n: int, args: argparse.Namespace) -> dict:
    out: dict = {"requests": 0, "tokens": 0, "errors": 0, "ttft": [], "itl": []}
    conn = aiohttp.TCPConnector(limit=0)
    async with aiohttp.ClientSession(connector=conn) as s:
        start = time.perf_counter()
        end = start + args.duration
        await asyncio.gather(*(client(s, url, model, args, end, out) for _ in range(n)))
        out["elapsed"] = time.perf_counter() - start
    return out


def spawn(tmp: Path) -> tuple[subprocess.Popen, str]:
    sys.path.insert(0, str(Path(__file__).parent))
    from common import make_model

    path = make_model(tmp)
    port = 8765
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "neo_rs.serve",
            "--model",
            str(path),
            "--port",
            str(port),
            "--dtype",
            "bfloat16",
            "--log-level",
            "warning",
        ]
    )
    url = f"http://127.0.0.1:{port}"
    for _ in range(600):
        try:
            with urllib.request.urlopen(url + "/health", timeout=1) as r:
                if r.status == 200:
                    return proc, url
        except OSError:
            time.sleep(0.2)
    proc.kill()
    raise SystemExit("the server did not start")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--url", default="http://127.0.0.1:8000")
    ap.add_argument("--spawn", action="store_true", help="serve the ~20M-parameter random Llama for the run")
    ap.add_argument("--concurrency", default="1,16,64")
    ap.add_argument("--duration", type=float, default=20.0)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--prompt-len", type=int, default=64, help="words (w100 w101 …) in the prompt")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        proc, url = spawn(Path(tmp)) if args.spawn else (None, args.url)
        try:
            with urllib.request.urlopen(url + "/v1/models") as r:
                model = json.loads(r.read())["data"][0]["id"]
            print(f"{model} at {url}: {args.duration:.0f} s per level, {args.max_tokens} tokens per request")
            print(
                f"{'streams':>8}{'req/s':>8}{'tok/s':>9}{'TTFT p50':>10}{'p99':>8}"
                f"{'ITL p50':>9}{'p99':>8}{'errors':>8}"
            )
            for n in (int(x) for x in args.concurrency.split(",")):
                r = asyncio.run(level(url, model, n, args))
                ms = lambda xs, q: pct(xs, q) * 1e3  # noqa: E731
                print(
                    f"{n:>8}{r['requests'] / r['elapsed']:>8.2f}{r['tokens'] / r['elapsed']:>9.1f}"
                    f"{ms(r['ttft'], 0.5):>9.1f}ms{ms(r['ttft'], 0.99):>6.0f}ms"
                    f"{ms(r['itl'], 0.5):>7.1f}ms{ms(r['itl'], 0.99):>6.0f}ms{r['errors']:>8}",
                    flush=True,
                )
        finally:
            if proc is not None:
                proc.terminate()
                proc.wait(60)


if __name__ == "__main__":
    main()
