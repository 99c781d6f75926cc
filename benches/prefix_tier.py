"""The prefix cache's host tier against recomputing: time to first token of a prompt whose long
shared prefix the device cache has evicted (a flush prompt took the device pool), with the host
tier on (the evicted blocks are copied back) and off (``cpu_prefix_cache_gib=0``: recomputed),
and as a reference with the prefix still on the device. Engines side by side in one process,
trials interleaved; the real model (SmolLM2-135M-Instruct) unless ``--model`` says otherwise.

``--in-place`` runs the same under ``--offload neo`` with a long request holding the whole device
pool when the prompt comes back: the prompt is bound for the host pool, and with the tier it
attends on the CPU over the host blocks where they lie (nothing copied); without it, it is
recomputed whole.

``--no-sharing`` measures the cost instead: throughput of prompts that share nothing, through a
device pool small enough that every finished request's cached blocks are evicted (and, with the
tier, stored on the host), with the tier, with the device cache alone, and with caching off.

    python benches/prefix_tier.py [--prefix-len 2000] [--suffix-len 32] [--trials 5]
    python benches/prefix_tier.py --in-place [--prefix-len 2000] [--suffix-len 32] [--trials 3]
    python benches/prefix_tier.py --no-sharing [--prompts 24] [--max-tokens 32] [--rounds 2]
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable

import torch
from neo_rs import LLMEngine, SamplingParams
from neo_rs.config import EngineArgs

BLOCK = 16
FIRST_TOKEN = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)
Tokens = Callable[[int], list[int]]


def ttft(engine: LLMEngine, prompt: list[int]) -> float:
    """Seconds from adding ``prompt`` to its first token, nothing else running."""
    t = time.perf_counter()
    engine.add_request(prompt, FIRST_TOKEN)
    while engine.has_unfinished():
        engine.step()
    return time.perf_counter() - t


def engines(args: argparse.Namespace, device_blocks: int, configs: dict[str, dict]) -> dict[str, LLMEngine]:
    """One engine per config, the pools alike: the host pool four times the device's (so the
    default tier, a quarter, holds as much as the device)."""
    return {
        name: LLMEngine(
            EngineArgs(
                model=args.model,
                num_gpu_blocks=device_blocks,
                num_cpu_blocks=4 * device_blocks,
                skip_tokenizer_init=True,
                **kw,
            )
        )
        for name, kw in configs.items()
    }


def report(title: str, times: dict[str, list[float]], base: str) -> None:
    b = statistics.median(times[base])
    print(f"{title:<18}{'TTFT p50 ms':>13}{'vs ' + base:>14}")
    for name, ts in times.items():
        p50 = statistics.median(ts)
        print(f"{name:<18}{p50 * 1e3:>13.1f}{p50 / b:>13.2f}x")


def copy_back(args: argparse.Namespace, tokens: Tokens) -> None:
    prefix = tokens(args.prefix_len)
    prompt_len = args.prefix_len + args.suffix_len
    # The device pool holds one prompt and a few blocks more: the flush prompt evicts the prefix.
    device_blocks = -(-(prompt_len + 1) // BLOCK) + 8
    tiers = engines(args, device_blocks, {"host tier": {}, "recompute": dict(cpu_prefix_cache_gib=0.0)})
    print(
        f"{args.model}: {args.prefix_len}-token shared prefix + {args.suffix_len}-token suffixes, "
        f"device pool {device_blocks} blocks of {BLOCK}, {args.trials} trials"
    )
    times: dict[str, list[float]] = {"device hit": [], "host tier": [], "recompute": []}
    for _ in range(args.trials):
        for name, engine in tiers.items():
            ttft(engine, prefix + tokens(args.suffix_len))  # the prefix is cached on the device
            if name == "host tier":
                times["device hit"].append(ttft(engine, prefix + tokens(args.suffix_len)))
            ttft(engine, tokens(prompt_len))  # flush: the prefix leaves the device
            times[name].append(ttft(engine, prefix + tokens(args.suffix_len)))
    st = tiers["host tier"].scheduler.stats()
    assert st["prefix_cache_host_hits"] > 0, st
    report("prefix", times, "recompute")
    print(
        f"host tier: {st['prefix_cache_host_hits'] // args.trials} tokens per measured prompt found "
        f"there, {st['num_cache_blocks_to_host']} blocks stored, {st['num_cache_blocks_to_device']} "
        "copied back"
    )


def in_place(args: argparse.Namespace, tokens: Tokens) -> None:
    prefix = tokens(args.prefix_len)
    prompt_len = args.prefix_len + args.suffix_len
    device_blocks = -(-(prompt_len + 1) // BLOCK) + 8
    # A host-bound prompt goes in one chunk: the budget takes it whole.
    neo = dict(offload="neo", max_num_batched_tokens=2 * prompt_len)
    tiers = engines(args, device_blocks, {"in place": neo, "recompute": dict(neo, cpu_prefix_cache_gib=0.0)})
    print(
        f"{args.model}, --offload neo: {args.prefix_len}-token shared prefix + {args.suffix_len}-token "
        f"suffixes while a long request holds the device pool ({device_blocks} blocks), {args.trials} trials"
    )
    # The filler's prompt evicts most of the prefix; its decodes, the rest: its KV grows to
    # fill the pool exactly.
    filler_tokens = device_blocks * BLOCK + 1 - prompt_len
    filler = SamplingParams(temperature=0, max_tokens=filler_tokens, ignore_eos=True)
    times: dict[str, list[float]] = {name: [] for name in tiers}
    for _ in range(args.trials):
        for name, engine in tiers.items():
            ttft(engine, prefix + tokens(args.suffix_len))  # the prefix is cached on the device
            engine.add_request(tokens(prompt_len), filler, request_id="filler")
            while engine.scheduler.num_free_blocks("gpu") > 0:  # the filler evicts the prefix
                assert engine.has_unfinished(), "the filler finished before filling the pool"
                engine.step()
            before = engine.scheduler.stats()
            t = time.perf_counter()
            engine.add_request(prefix + tokens(args.suffix_len), FIRST_TOKEN, request_id="again")
            while not any(o.request_id == "again" for o in engine.step()):
                pass
            times[name].append(time.perf_counter() - t)
            after = engine.scheduler.stats()
            if name == "in place":  # found on the host and used there, nothing copied
                found = after["prefix_cache_host_hits"] - before["prefix_cache_host_hits"]
                assert found >= args.prefix_len - BLOCK, found
                assert after["num_cache_blocks_to_device"] == before["num_cache_blocks_to_device"]
            engine.abort("filler")
            while engine.has_unfinished():
                engine.step()
    report("neo, device full", times, "recompute")


def no_sharing(args: argparse.Namespace, tokens: Tokens) -> None:
    g = torch.Generator().manual_seed(1)
    lens = torch.randint(128, 257, (args.prompts,), generator=g).tolist()
    batch = [tokens(n) for n in lens]
    # Room for a quarter of the batch at a time: later requests evict earlier ones' blocks.
    device_blocks = sum(-(-(n + args.max_tokens) // BLOCK) for n in lens) // 4
    seats = dict(max_num_seqs=max(1, args.prompts // 4))
    configs = {
        "host tier": seats,
        "device only": dict(seats, cpu_prefix_cache_gib=0.0),
        "caching off": dict(seats, enable_prefix_caching=False),
    }
    runs = engines(args, device_blocks, configs)
    params = SamplingParams(temperature=0, max_tokens=args.max_tokens, ignore_eos=True)
    print(
        f"{args.model}: {args.prompts} prompts sharing nothing (128-256 tokens) x {args.max_tokens} "
        f"tokens, device pool {device_blocks} blocks, {args.rounds} rounds"
    )
    rates: dict[str, list[float]] = {name: [] for name in runs}
    for _ in range(args.rounds):
        for name, engine in runs.items():
            t = time.perf_counter()
            for p in batch:
                engine.add_request(p, params)
            while engine.has_unfinished():
                engine.step()
            rates[name].append(len(batch) * args.max_tokens / (time.perf_counter() - t))
    base = statistics.median(rates["caching off"])
    print(f"{'':<14}{'tok/s p50':>10}{'vs off':>9}  blocks stored on the host")
    for name, r in rates.items():
        stored = runs[name].scheduler.stats()["num_cache_blocks_to_host"]
        print(f"{name:<14}{statistics.median(r):>10.1f}{statistics.median(r) / base:>8.3f}x  {stored}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--prefix-len", type=int, default=2000)
    ap.add_argument("--suffix-len", type=int, default=32)
    ap.add_argument("--trials", type=int, default=5)
    ap.add_argument("--in-place", action="store_true")
    ap.add_argument("--no-sharing", action="store_true")
    ap.add_argument("--prompts", type=int, default=24)
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--rounds", type=int, default=2)
    args = ap.parse_args()
    g = torch.Generator().manual_seed(0)

    def tokens(n: int) -> list[int]:
        return torch.randint(100, 40000, (n,), generator=g).tolist()

    run = no_sharing if args.no_sharing else in_place if args.in_place else copy_back
    run(args, tokens)


if __name__ == "__main__":
    main()
