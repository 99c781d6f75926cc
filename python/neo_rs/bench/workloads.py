"""Seeded request workloads: lengths only (prompts are sent as token ids, so lengths are exact
on any server that accepts token-id prompts, as vLLM and neo_rs do).

- ``synthetic``: input and output lengths uniform in +-10% around the given means (NEO's paper).
- ``osc``: shaped like the OpenAI summarization comparison set NEO used: prompts 29-589 tokens
  (normal, mean 372, sd 120, clipped), outputs 15-129 (normal, mean 45, sd 25, clipped).
- ``azure-code``: shaped like the Azure LLM inference trace's code requests: long prompts
  (log-normal, median 1500, clipped to 100-7500) and short outputs (log-normal, median 20,
  clipped to 4-200, mean ~28).
- ``shared-prefix``: chat with a long common system prompt. ``--num-requests`` turns over
  ``ceil(num_requests / turns)`` conversations (``--turns``, default 3); every prompt starts with
  the same ``--prefix-len`` tokens (default 2000), then the conversation so far: each earlier
  turn's user message (``--input-len`` +-10%) and a stand-in for its reply (``--output-len``
  tokens, the reply length asked for), then the new user message. Turn-major order (every
  conversation's first turn, then every second turn, ...), so with a finite rate follow-ups
  arrive after the turns they extend. The bench reports the prefix-cache hit rate.
- a JSONL file: one object per line with ``prompt_len`` and ``output_len`` (or ``prompt`` text
  and ``output_len``).
"""

from __future__ import annotations

import json
import random
from dataclasses import dataclass, replace
from pathlib import Path


@dataclass(frozen=True)
class BenchRequest:
    prompt_len: int
    output_len: int
    prompt: str | None = None  # text instead of token ids (JSONL workloads)
    ids: tuple[int, ...] | None = None  # the prompt's token ids (shared-prefix workloads)


def synthetic(n: int, input_len: int, output_len: int, seed: int) -> list[BenchRequest]:
    rng = random.Random(seed)

    def around(mean: int) -> int:
        return max(1, round(rng.uniform(0.9 * mean, 1.1 * mean)))

    return [BenchRequest(around(input_len), around(output_len)) for _ in range(n)]


def _clipped(rng: random.Random, draw: float, lo: int, hi: int) -> int:
    return int(min(hi, max(lo, round(draw))))


def osc(n: int, seed: int) -> list[BenchRequest]:
    rng = random.Random(seed)
    return [
        BenchRequest(_clipped(rng, rng.gauss(372, 120), 29, 589), _clipped(rng, rng.gauss(45, 25), 15, 129))
        for _ in range(n)
    ]


def azure_code(n: int, seed: int) -> list[BenchRequest]:
    rng = random.Random(seed)
    return [
        BenchRequest(
            _clipped(rng, rng.lognormvariate(7.31, 0.8), 100, 7500),  # median e^7.31 ~ 1500
            _clipped(rng, rng.lognormvariate(3.0, 0.8), 4, 200),  # median e^3 ~ 20
        )
        for _ in range(n)
    ]


def shared_prefix(
    n: int, prefix_len: int, input_len: int, output_len: int, turns: int, vocab: int, seed: int
) -> list[BenchRequest]:
    rng = random.Random(seed)

    def tokens(k: int) -> list[int]:
        return [rng.randrange(3, vocab) for _ in range(k)]

    def around(mean: int) -> int:
        return max(1, round(rng.uniform(0.9 * mean, 1.1 * mean)))

    system = tokens(prefix_len)
    convs = [list(system) for _ in range(-(-n // turns))]
    out: list[BenchRequest] = []
    for _ in range(turns):
        for history in convs:
            if len(out) == n:
                break
            history.extend(tokens(around(input_len)))
            out.append(BenchRequest(len(history), output_len, ids=tuple(history)))
            history.extend(tokens(output_len))  # the reply, as the next turn will resend it
    return out


def from_jsonl(path: Path, n: int | None) -> list[BenchRequest]:
    out = []
    for lineno, line in enumerate(path.read_text().splitlines(), 1):
        if not line.strip():
            continue
        d = json.loads(line)
        if "output_len" not in d or not ("prompt_len" in d or "prompt" in d):
            raise ValueError(f"{path}:{lineno}: needs output_len and prompt_len or prompt")
        prompt = d.get("prompt")
        out.append(BenchRequest(int(d.get("prompt_len") or 0), int(d["output_len"]), prompt))
    return out[:n] if n else out


def make(
    kind: str,
    n: int,
    input_len: int,
    output_len: int,
    seed: int,
    *,
    prefix_len: int = 2000,
    turns: int = 3,
    vocab: int = 256,
) -> list[BenchRequest]:
    """``kind``: ``synthetic`` (around ``input_len`` / ``output_len``), ``osc``, ``azure-code``,
    ``shared-prefix`` (``prefix_len``, ``turns``; token ids below ``vocab``), or the path of a
    JSONL file."""
    if kind == "shared-prefix":
        return shared_prefix(n, prefix_len, input_len, output_len, turns, vocab, seed)
    if kind == "synthetic":
        reqs = synthetic(n, input_len, output_len, seed)
    elif kind == "osc":
        reqs = osc(n, seed)
    elif kind == "azure-code":
        reqs = azure_code(n, seed)
    else:
        return from_jsonl(Path(kind), n)
    # Distinct prompts, drawn from the seed: no two share a block, within a run or across seeds.
    rng = random.Random(f"prompts-{seed}")
    return [replace(r, ids=tuple(rng.randrange(3, vocab) for _ in range(r.prompt_len))) for r in reqs]


def prompt_ids(req: BenchRequest, index: int, vocab: int) -> list[int]:
    """The request's own ids, or ids drawn from ``index`` (the bench's warm-up requests)."""
    if req.ids is not None:
        return list(req.ids)
    rng = random.Random(index)
    return [rng.randrange(3, vocab) for _ in range(req.prompt_len)]
