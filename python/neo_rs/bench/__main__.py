"""``python -m neo_rs.bench``: benchmark a running OpenAI-compatible server, or (``--compare``)
plot runs saved earlier side by side.

    python -m neo_rs.bench --url http://127.0.0.1:8000 --workload synthetic --input-len 1000 \\
        --output-len 200 --num-requests 200 --rate 1,2,4 --label neo --out neo.json --plot neo.png
    python -m neo_rs.bench --compare neo.json none.json all.json --plot compare.png
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import urllib.request
from pathlib import Path
from typing import Any

from neo_rs.bench import report, workloads
from neo_rs.bench.arrivals import arrival_times
from neo_rs.bench.client import run


def _slo(items: list[str]) -> tuple[float | None, float | None]:
    ttft = tpot = None
    for item in items:
        key, _, value = item.partition(":")
        if key == "ttft":
            ttft = float(value)
        elif key == "tpot":
            tpot = float(value)
        else:
            raise SystemExit(f"--slo: unknown item {item!r} (use ttft:MS tpot:MS)")
    return ttft, tpot


def _model(url: str) -> tuple[str, int]:
    with urllib.request.urlopen(url + "/v1/models", timeout=30) as r:
        card = json.loads(r.read())["data"][0]
    return card["id"], int(card.get("max_model_len") or 0)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(
        prog="python -m neo_rs.bench",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    ap.add_argument("--url", default="http://127.0.0.1:8000")
    ap.add_argument("--model", help="model name (default: the server's first)")
    ap.add_argument(
        "--workload", default="synthetic", help="synthetic | osc | azure-code | shared-prefix | FILE.jsonl"
    )
    ap.add_argument("--input-len", type=int, default=1000)
    ap.add_argument("--output-len", type=int, default=200)
    ap.add_argument("--num-requests", type=int, default=200)
    ap.add_argument("--rate", default="inf", help="requests/s (inf: all at once); a list sweeps")
    ap.add_argument("--prefix-len", type=int, default=2000, help="shared-prefix: system prompt tokens")
    ap.add_argument("--turns", type=int, default=3, help="shared-prefix: turns per conversation")
    ap.add_argument("--burstiness", type=float, default=1.0, help="gamma shape (1 = Poisson)")
    ap.add_argument("--max-concurrency", type=int)
    ap.add_argument("--warmup", type=int, default=2, help="requests sent first and not measured")
    ap.add_argument("--vocab", type=int, default=256, help="token ids of synthetic prompts are below this")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--slo", nargs="*", default=[], help="goodput targets: ttft:MS tpot:MS")
    ap.add_argument("--label", default="run")
    ap.add_argument("--out", type=Path, help="JSON file of every run")
    ap.add_argument("--plot", type=Path, help="PNG of the load-latency curves and throughput")
    ap.add_argument("--compare", nargs="+", type=Path, help="plot these JSON files together; no run")
    args = ap.parse_args(argv)

    if args.compare:
        runs: list[dict[str, Any]] = [r for f in args.compare for r in json.loads(f.read_text())]
        for r in runs:
            print(report.table(r["label"], r["rate"], r["summary"]))
        if args.plot:
            report.plot(args.plot, runs)
        return
    model, _ = (args.model, 0) if args.model else _model(args.url)
    slo_ttft, slo_tpot = _slo(args.slo)
    runs = []
    for k, rate in enumerate(float(x) for x in args.rate.split(",")):
        # A fresh draw per rate: a prefix cache must not serve one rate's prompts to the next.
        requests = workloads.make(
            args.workload,
            args.num_requests,
            args.input_len,
            args.output_len,
            args.seed + k,
            prefix_len=args.prefix_len,
            turns=args.turns,
            vocab=args.vocab,
        )
        times = arrival_times(len(requests), rate, args.burstiness, args.seed)
        result = asyncio.run(
            run(args.url, model, requests, times, args.max_concurrency, args.vocab, args.warmup)
        )
        summary = report.summarize(result, slo_ttft, slo_tpot)
        print(report.table(args.label, rate, summary), flush=True)
        runs.append({"label": args.label, "rate": rate, "workload": args.workload, "summary": summary})
    if args.out:
        report.write_json(args.out, runs)
    if args.plot:
        report.plot(args.plot, runs)
    if any(r["summary"]["failed"] for r in runs):
        sys.exit(1)


if __name__ == "__main__":
    main()
