"""The prefix cache's host tier against recomputing: time to first token of a prompt whose long
shared prefix the device cache has evicted (a flush prompt took the device pool), with the host
tier on (the evicted blocks are copied back) and off (``cpu_prefix_cache_gib=0``: recomputed),
and as a reference with the prefix still on the device. Engines side by side in one process,
trials interleaved; the real model (SmolLM2-135M-Instruct) unless ``--model`` says otherwise.

``--no-sharing`` measures the cost instead: throughput of prompts that share nothing, through a
device pool small enough that every finished request's cached blocks are evicted (and, with the
tier, stored on the host), with the tier, with the device cache alone, and with caching off.

    python benches/prefix_tier.py [--prefix-len 2000] [--suffix-len 32] [--trials 5]
    python benches/prefix_tier.py --no-sharing [--prompts 24] [--max-tokens 32] [--rounds 2]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
from neo_rs import LLMEngine, SamplingParams
from neo_rs.config import EngineArgs

BLOCK = 16
FIRST_TOKEN = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)


def ttft(engine: LLMEngine, prompt: list[int]) -> float:
    """Seconds from adding ``prompt`` to its first token, nothing else running."""
    t = time.perf_counter()
    engine.add_request(prompt, FIRST_TOKEN)
    while engine.has_unfinished():
        engine.step()
    return time.perf_counter() - t


def no_sharing(args: argparse.Namespace) -> None:
    g = torch.Generator().manual_seed(1)
    lens = torch.randint(128, 257, (args.prompts,), generator=g).tolist()
    batch = [torch.randint(100, 40000, (n,), generator=g).tolist() for n in lens]
    # Room for a quarter of the batch at a time: later requests evict earlier ones' blocks.
    device_blocks = sum(-(-(n + args.max_tokens) // BLOCK) for n in lens) // 4
    configs = {
        "host tier": dict(),
        "device only": dict(cpu_prefix_cache_gib=0.0),
        "caching off": dict(enable_prefix_caching=False),
    }
    engines = {
        name: LLMEngine(
            EngineArgs(
                model=args.model,
                num_gpu_blocks=device_blocks,
                num_cpu_blocks=4 * device_blocks,
                max_num_seqs=max(1, args.prompts // 4),
                skip_tokenizer_init=True,
                **kw,
            )
        )
        for name, kw in configs.items()
    }
    params = SamplingParams(temperature=0, max_tokens=args.max_tokens, ignore_eos=True)
    print(
        f"{args.model}: {args.prompts} prompts sharing nothing (128-256 tokens) x {args.max_tokens} "
        f"tokens, device pool {device_blocks} blocks, {args.rounds} rounds"
    )
    rates: dict[str, list[float]] = {name: [] for name in engines}
    for _ in range(args.rounds):
        for name, engine in engines.items():
            t = time.perf_counter()
            for p in batch:
                engine.add_request(p, params)
            while engine.has_unfinished():
                engine.step()
            rates[name].append(len(batch) * args.max_tokens / (time.perf_counter() - t))
    base = statistics.median(rates["caching off"])
    print(f"{'':<14}{'tok/s p50':>10}{'vs off':>9}  blocks stored on the host")
    for name, r in rates.items():
        stored = engines[name].scheduler.stats()["num_cache_blocks_to_host"]
        print(f"{name:<14}{statistics.median(r):>10.1f}{statistics.median(r) / base:>8.3f}x  {stored}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--prefix-len", type=int, default=2000)
    ap.add_argument("--suffix-len", type=int, default=32)
    ap.add_argument("--trials", type=int, default=5)
    ap.add_argument("--no-sharing", action="store_true")
    ap.add_argument("--prompts", type=int, default=24)
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--rounds", type=int, default=2)
    args = ap.parse_args()
    if args.no_sharing:
        no_sharing(args)
        return
    g = torch.Generator().manual_seed(0)

    def tokens(n: int) -> list[int]:
        return torch.randint(100, 40000, (n,), generator=g).tolist()

    prefix = tokens(args.prefix_len)
    prompt_len = args.prefix_len + args.suffix_len
    # The device pool holds one prompt and a few blocks more: the flush prompt evicts the prefix.
    device_blocks = -(-(prompt_len + 1) // BLOCK) + 8
    engines = {}
    for name, tier_gib in (("host tier", None), ("recompute", 0.0)):
        engines[name] = LLMEngine(
            EngineArgs(
                model=args.model,
                num_gpu_blocks=device_blocks,
                num_cpu_blocks=4 * device_blocks,  # the default tier: a quarter, one prefix
                cpu_prefix_cache_gib=tier_gib,
                skip_tokenizer_init=True,
            )
        )
    print(
        f"{args.model}: {args.prefix_len}-token shared prefix + {args.suffix_len}-token suffixes, "
        f"device pool {device_blocks} blocks of {BLOCK}, {args.trials} trials"
    )
    times: dict[str, list[float]] = {"device hit": [], "host tier": [], "recompute": []}
    for _ in range(args.trials):
        for name, engine in engines.items():
            ttft(engine, prefix + tokens(args.suffix_len))  # the prefix is cached on the device
            if name == "host tier":
                times["device hit"].append(ttft(engine, prefix + tokens(args.suffix_len)))
            ttft(engine, tokens(prompt_len))  # flush: the prefix leaves the device
            times[name].append(ttft(engine, prefix + tokens(args.suffix_len)))
    st = engines["host tier"].scheduler.stats()
    assert st["prefix_cache_host_hits"] > 0, st
    base = statistics.median(times["recompute"])
    print(f"{'prefix':<12}{'TTFT p50 ms':>13}{'vs recompute':>14}")
    for name, ts in times.items():
        p50 = statistics.median(ts)
        print(f"{name:<12}{p50 * 1e3:>13.1f}{p50 / base:>13.2f}x")
    print(
        f"host tier: {st['prefix_cache_host_hits'] // args.trials} tokens per measured prompt found "
        f"there, {st['num_cache_blocks_to_host']} blocks stored, {st['num_cache_blocks_to_device']} "
        "copied back"
    )


if __name__ == "__main__":
    main()
