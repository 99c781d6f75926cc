"""Speculative decoding by prompt lookup against decoding without it, SmolLM2-135M-Instruct on the
CPU device, 2 threads, in one process (two engines, runs alternated).

Workload: tasks whose answer repeats its input, from a seeded generator: a paragraph of
sentences drawn from a fixed pool, and an instruction to copy it, to copy it with one word
replaced, or to continue a numbered list it starts. Chat-templated, greedy, 128 new tokens.

- one stream: each task alone, ``--pairs`` alternated off/on passes over the tasks; prints
  tokens/s of each pass, the median ratio, the acceptance rate (drafts accepted / drafted), the
  mean tokens per verifying step (accepted drafts + 1) and the acceptance at each position;
- 64 streams: every task at once (tasks repeated to 64), off then on, alternated; the policy is
  meant to turn speculation off where rows stop being nearly free, so the ratio should stay
  near 1.

    python benches/spec_decode.py [--pairs 3] [--tokens 128] [--quantization none]
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from common import cpu_line  # noqa: E402

MODEL = "smollm2-135m-instruct"
SPEC = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 2, "prompt_lookup_max": 4}
THREADS = 2
SENTENCES = [
    "The committee met on Tuesday to review the budget.",
    "It approved the new library wing and postponed the road repairs.",
    "Members asked for a detailed cost report before the next meeting.",
    "The chair thanked the volunteers who organised the consultation.",
    "Rain is expected over the weekend in the northern valleys.",
    "The bakery on Mill Street now opens at six in the morning.",
    "Tickets for the autumn concert go on sale next Friday.",
    "The river path will close for two weeks while the bridge is painted.",
    "A new bus route links the station with the hospital.",
    "The school choir won second prize at the regional festival.",
]


def tasks(n: int, seed: int = 0) -> list[str]:
    rng = random.Random(seed)
    out = []
    for i in range(n):
        text = " ".join(rng.sample(SENTENCES, 4))
        kind = i % 3
        if kind == 0:
            out.append(f"Copy the following text exactly, word for word:\n\n{text}")
        elif kind == 1:
            old = rng.choice([w for w in text.split() if len(w) > 4]).strip(".,")
            out.append(f"Repeat this text, replacing the word '{old}' with 'XYZ' everywhere:\n\n{text}")
        else:
            items = "\n".join(f"{j + 1}. {s}" for j, s in enumerate(rng.sample(SENTENCES, 3)))
            out.append(f"Here is a numbered list. Write it out again in full:\n\n{items}")
    return out


def engine(spec: dict | None, quantization: str, seqs: int):  # noqa: ANN201
    from neo_rs import LLM

    return LLM(
        MODEL,
        dtype="bfloat16",
        quantization=quantization,
        cpu_threads=THREADS,
        max_num_seqs=seqs,
        speculative_config=spec,
    )


def run(llm, prompts: list[list[int]], tokens: int, one_at_a_time: bool) -> tuple[float, dict[str, float]]:  # noqa: ANN001
    """Tokens/s, and the drafts verified and accepted (at each position) during the run."""
    from neo_rs import SamplingParams

    params = SamplingParams(temperature=0, max_tokens=tokens, ignore_eos=True)
    e, counts = llm.engine, {"drafts": 0.0, "accepted": 0.0, "verifying": 0.0}
    per_pos: list[float] = []
    step = e.step

    def counting() -> list:
        outs = step()
        if (s := e.last_stats) is not None:
            counts["drafts"] += s.num_draft_tokens
            counts["accepted"] += sum(s.accepted_per_position)
            counts["verifying"] += s.num_drafts
            for i, n in enumerate(s.accepted_per_position):
                per_pos.extend([0.0] * (i + 1 - len(per_pos)))
                per_pos[i] += n
        return outs

    e.step = counting
    batches = [[p] for p in prompts] if one_at_a_time else [prompts]
    t = time.perf_counter()
    for b in batches:
        llm.generate(b, params, use_tqdm=False)
    elapsed = time.perf_counter() - t
    e.step = step
    counts["per_pos"] = per_pos  # type: ignore[assignment]
    return len(prompts) * tokens / elapsed, counts


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--pairs", type=int, default=3)
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--tasks", type=int, default=6)
    ap.add_argument("--quantization", default="none", help="none: bf16 weights (the GGUF dequantized)")
    ap.add_argument("--spec", default=json.dumps(SPEC), help="the speculative config, vLLM's JSON")
    args = ap.parse_args()
    import torch

    torch.set_num_threads(THREADS)
    spec = json.loads(args.spec)
    print(f"CPU: {cpu_line()}, {THREADS} threads; {MODEL}, quantization {args.quantization}; {spec}")
    for streams in (1, 64):
        off, on = engine(None, args.quantization, streams), engine(spec, args.quantization, streams)
        tok = off.get_tokenizer()
        texts = tasks(args.tasks if streams == 1 else 64)
        chats = [
            tok.apply_chat_template(
                [{"role": "user", "content": t}], tokenize=False, add_generation_prompt=True
            )
            for t in texts
        ]
        prompts = [tok.encode(c, add_special_tokens=False) for c in chats]
        tokens = args.tokens if streams == 1 else args.tokens // 2
        for llm in (off, on):  # warm-up: the first shapes, the profile
            run(llm, prompts[:1], 8, True)
        ratios, stats = [], []
        for _ in range(args.pairs if streams == 1 else max(1, args.pairs - 1)):
            a, _ = run(off, prompts, tokens, streams == 1)
            b, c = run(on, prompts, tokens, streams == 1)
            ratios.append(b / a)
            stats.append(c)
            print(f"  {streams:>2} stream(s): off {a:7.1f} tok/s, on {b:7.1f} tok/s ({b / a:.2f}x)")
        drafted = sum(c["drafts"] for c in stats)
        accepted = sum(c["accepted"] for c in stats)
        verifying = sum(c["verifying"] for c in stats)
        per_pos = [sum(c["per_pos"][i] for c in stats if len(c["per_pos"]) > i) for i in range(4)]
        rate = accepted / drafted if drafted else 0.0
        mean_len = 1 + accepted / verifying if verifying else 1.0
        at_pos = ", ".join(f"{n / verifying:.2f}" if verifying else "-" for n in per_pos)
        print(
            f"{streams} stream(s): median {statistics.median(ratios):.2f}x; drafted {drafted:.0f}, "
            f"accepted {accepted:.0f} ({rate:.0%}), mean accepted length {mean_len:.2f} "
            f"tokens per verifying step, acceptance by position [{at_pos}]"
        )
        off.shutdown()
        on.shutdown()


if __name__ == "__main__":
    main()
