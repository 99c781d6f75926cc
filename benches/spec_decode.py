"""Speculative decoding against decoding without it, on the CPU device, 2 threads, in one process
(the engines' runs alternated): prompt lookup on SmolLM2-135M-Instruct, or (``--draft-model``)
SmolLM2-135M-Instruct drafting for a Llama-3.2-1B-shaped model of its vocabulary with random
weights.

Workload: tasks whose answer repeats its input, from a seeded generator: a paragraph of eight
sentences drawn from a fixed pool, and an instruction to copy it, to copy it with one word
replaced, or to write out again a numbered list of six. Chat-templated, greedy, up to 128 new
tokens, ending where the model ends its answer: past its end of sequence SmolLM2 goes on to
invent a new conversation, which repeats nothing (an earlier version of this bench, with four
sentences and 128 tokens whatever the end, timed mostly that). The random target of
``--draft-model`` is run past its end of sequence, 128 tokens a prompt.

- one stream: each task alone, ``--pairs`` alternated off/on passes over the tasks; prints
  tokens/s of each pass, the median ratio, the acceptance rate (drafts accepted / drafted), the
  mean tokens per verifying step (accepted drafts + 1) and the acceptance at each position;
- 64 streams: every task at once (tasks repeated to 64), off then on, alternated; the policy is
  meant to turn speculation off where rows stop being nearly free, so the ratio should stay
  near 1.

A random target accepts next to none of a real model's drafts (the policy then stops drafting),
so ``--draft-model`` also times a third engine at a forced acceptance of 0.7
(``NEO_RS_FORCE_ACCEPTANCE``: each draft kept with that probability, whatever the target samples).

    python benches/spec_decode.py [--pairs 3] [--tokens 128] [--quantization none] [--draft-model]
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from common import cpu_line, random_llama  # noqa: E402

MODEL = "smollm2-135m-instruct"
SPEC = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 2, "prompt_lookup_max": 4}
DRAFT_SPEC = {"method": "draft_model", "model": MODEL, "num_speculative_tokens": 4}
# Llama-3.2-1B's shape with SmolLM2's vocabulary (its tokenizer, so that SmolLM2 can draft).
TARGET_1B = (2048, 8192, 32, 8, 64, 16, 49152)
FORCED = 0.7
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
        text = " ".join(rng.sample(SENTENCES, 8))
        kind = i % 3
        if kind == 0:
            out.append(f"Copy the following text exactly, word for word:\n\n{text}")
        elif kind == 1:
            old = rng.choice([w for w in text.split() if len(w) > 4]).strip(".,")
            out.append(f"Repeat this text, replacing the word '{old}' with 'XYZ' everywhere:\n\n{text}")
        else:
            items = "\n".join(f"{j + 1}. {s}" for j, s in enumerate(rng.sample(SENTENCES, 6)))
            out.append(f"Here is a numbered list. Write it out again in full:\n\n{items}")
    return out


def engine(model: str, spec: dict | None, quantization: str, seqs: int, forced: float | None = None):  # noqa: ANN201
    from neo_rs import LLM

    if forced is not None:  # read as the engine is built
        os.environ["NEO_RS_FORCE_ACCEPTANCE"] = str(forced)
    try:
        return LLM(
            model,
            dtype="bfloat16",
            quantization=quantization,
            cpu_threads=THREADS,
            max_num_seqs=seqs,
            speculative_config=spec,
        )
    finally:
        os.environ.pop("NEO_RS_FORCE_ACCEPTANCE", None)


def random_target(root: Path) -> str:
    """The 1B-shaped random target, with SmolLM2's tokenizer files."""
    from neo_rs.model.registry import resolve_model

    path = random_llama(root, TARGET_1B)
    for f in resolve_model(MODEL, "bfloat16").iterdir():
        if f.name.startswith(("tokenizer", "special_tokens", "chat_template")):
            shutil.copy(f, path / f.name)
    return str(path)


def run(llm, prompts: list[list[int]], tokens: int, one_at_a_time: bool, ignore_eos: bool):  # noqa: ANN001, ANN201
    """Tokens/s (those generated, up to ``tokens`` a prompt), and the drafts verified and accepted
    (at each position) during the run."""
    from neo_rs import SamplingParams

    params = SamplingParams(temperature=0, max_tokens=tokens, ignore_eos=ignore_eos)
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
    generated = 0
    t = time.perf_counter()
    for b in batches:
        generated += sum(len(o.outputs[0].token_ids) for o in llm.generate(b, params, use_tqdm=False))
    elapsed = time.perf_counter() - t
    e.step = step
    counts["per_pos"] = per_pos  # type: ignore[assignment]
    counts["tokens"] = generated
    return generated / elapsed, counts


def summary(label: str, ratios: list[float], stats: list[dict]) -> str:
    drafted = sum(c["drafts"] for c in stats)
    accepted = sum(c["accepted"] for c in stats)
    verifying = sum(c["verifying"] for c in stats)
    positions = max(len(c["per_pos"]) for c in stats)
    per_pos = [sum(c["per_pos"][i] for c in stats if len(c["per_pos"]) > i) for i in range(positions)]
    rate = accepted / drafted if drafted else 0.0
    mean_len = 1 + accepted / verifying if verifying else 1.0
    at_pos = ", ".join(f"{n / verifying:.2f}" if verifying else "-" for n in per_pos)
    return (
        f"{label}: median {statistics.median(ratios):.2f}x over {stats[0]['tokens']:.0f} tokens a pass; "
        f"drafted {drafted:.0f}, "
        f"accepted {accepted:.0f} ({rate:.0%}), mean accepted length {mean_len:.2f} "
        f"tokens per verifying step, acceptance by position [{at_pos}]"
    )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--pairs", type=int, default=3)
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--tasks", type=int, default=6)
    ap.add_argument("--quantization", default="none", help="none: bf16 weights (the GGUF dequantized)")
    ap.add_argument("--spec", default=None, help="the speculative config, vLLM's JSON")
    ap.add_argument("--draft-model", action="store_true", help="SmolLM2 drafting for a random 1B shape")
    args = ap.parse_args()
    import torch

    torch.set_num_threads(THREADS)
    spec = json.loads(args.spec) if args.spec else DRAFT_SPEC if args.draft_model else SPEC
    with tempfile.TemporaryDirectory() as tmp:
        model = random_target(Path(tmp)) if args.draft_model else MODEL
        name = "Llama-3.2-1B shape (random), SmolLM2 vocabulary" if args.draft_model else MODEL
        print(f"CPU: {cpu_line()}, {THREADS} threads; {name}, quantization {args.quantization}; {spec}")
        for streams in (1, 64):
            engines = {
                "off": engine(model, None, args.quantization, streams),
                "on": engine(model, spec, args.quantization, streams),
            }
            if args.draft_model and streams == 1:
                engines[f"forced {FORCED}"] = engine(model, spec, args.quantization, streams, FORCED)
            compare(engines, streams, args)
            for llm in engines.values():
                llm.shutdown()


def compare(engines: dict, streams: int, args: argparse.Namespace) -> None:
    """Alternated passes of every engine over the tasks; each one's ratio against "off"."""
    off = engines["off"]
    tok = off.get_tokenizer()
    texts = tasks(args.tasks if streams == 1 else 64)
    chats = [
        tok.apply_chat_template([{"role": "user", "content": t}], tokenize=False, add_generation_prompt=True)
        for t in texts
    ]
    prompts = [tok.encode(c, add_special_tokens=False) for c in chats]
    tokens = args.tokens if streams == 1 else args.tokens // 2
    for llm in engines.values():  # warm-up: the shapes, the profile, the rates, the memory
        run(llm, prompts, tokens, streams == 1, args.draft_model)
    ratios: dict[str, list[float]] = {k: [] for k in engines if k != "off"}
    stats: dict[str, list[dict]] = {k: [] for k in ratios}
    for _ in range(args.pairs if streams == 1 else max(1, args.pairs - 1)):
        base, _ = run(off, prompts, tokens, streams == 1, args.draft_model)
        line = f"  {streams:>2} stream(s): off {base:7.1f} tok/s"
        for label in ratios:
            rate, counts = run(engines[label], prompts, tokens, streams == 1, args.draft_model)
            ratios[label].append(rate / base)
            stats[label].append(counts)
            line += f", {label} {rate:7.1f} tok/s ({rate / base:.2f}x)"
        print(line)
    for label in ratios:
        print(summary(f"{streams} stream(s), {label}", ratios[label], stats[label]))


if __name__ == "__main__":
    main()
