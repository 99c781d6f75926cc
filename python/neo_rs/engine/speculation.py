"""Drafts verified after the forward pass. The scheduler gives a decode that drafted ``k``
tokens ``k + 1`` consecutive sampled rows: row ``j`` reads the last sampled token and drafts
``1..j``, so it samples what follows draft ``j`` exactly as a decode at that position would
(penalties and ``min_tokens`` count the drafts before it; a grammar's mask is its state after
them). Each row samples as usual; a sequence
keeps the drafts while each row's token equals the next draft, then the first token that
differs (or, all accepted, the last row's).

For greedy rows that is decoding one token at a time. For sampled rows it is Leviathan et al.'s
rejection sampling with a draft distribution that puts all its mass on the draft ``d`` (prompt
lookup proposes tokens, not distributions): that rule accepts ``d`` with probability ``p(d)``
and otherwise draws from ``p`` without ``d``, which is what drawing ``x ~ p`` and accepting iff
``x = d`` does. So every token keeps the model's distribution. A seeded sequence's generator is
rewound to have drawn one number per token kept: its tokens are those it samples without
speculation, however many drafts each step verified."""

from __future__ import annotations

import random
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from neo_rs._core import SchedulerOutput
from neo_rs.engine.sequence import Sequence
from neo_rs.sample.sampling import SampleResult, SampleRow


@dataclass
class Verification:
    """One iteration's sampled rows and what the sequences took from them."""

    seqs: list[Sequence]  # each sampled sequence once, in plan order
    runs: list[slice]  # each sequence's rows
    rows: list[SampleRow]
    drafts: list[int | None]  # the draft each row verifies (None: a last row)
    num_drafted: int = 0  # sequences that verified drafts
    accepted: list[int] = field(default_factory=list)  # per drafted sequence, in order
    # Seeded drafted sequences' generator states before the rows drew from them.
    rewind: dict[int, torch.Tensor] = field(default_factory=dict)

    @staticmethod
    def of(plan: SchedulerOutput, row_seqs: list[Sequence]) -> Verification:
        """``row_seqs``: the sequence of each sampled row (``plan.sample_ids``)."""
        ids, sample_rows = plan.sample_ids, plan.sample_rows
        starts = np.flatnonzero(np.diff(ids, prepend=-1)).tolist() if len(ids) else []
        bounds = [*starts, len(ids)]
        v = Verification([], [], [], [])
        for lo, hi in zip(bounds, bounds[1:], strict=False):
            seq = row_seqs[lo]
            v.seqs.append(seq)
            v.runs.append(slice(lo, hi))
            if hi - lo == 1:  # no drafts (every row without speculation): the plan is not read
                v.rows.append(seq.sample_row())
                v.drafts.append(None)
                continue
            # Row j's input is draft j (row 0's the last sampled token): row j verifies the next.
            drafts = plan.input_ids[sample_rows[lo] + 1 : sample_rows[hi - 1] + 1].tolist()
            v.rows.extend(seq.sample_row(drafts[:j]) for j in range(hi - lo))
            v.drafts.extend([*drafts, None])
            v.num_drafted += 1
            if seq.generator is not None and not seq.params.greedy:
                v.rewind[seq.seq_id] = seq.generator.get_state()
        return v

    @property
    def num_draft_tokens(self) -> int:
        return len(self.rows) - len(self.seqs)

    def accepted_per_position(self) -> list[int]:
        """How many sequences accepted their ``i``-th draft, for each ``i``."""
        longest = max((r.stop - r.start - 1 for r in self.runs), default=0)
        return [sum(a > i for a in self.accepted) for i in range(longest)]

    def constrained(self) -> list[tuple[Any, int, list[int]]]:
        """The sequences with a grammar: matcher, first row and drafts (``Grammars.start_masks``)."""
        return [
            (seq.matcher, run.start, [d for d in self.drafts[run.start : run.stop] if d is not None])
            for seq, run in zip(self.seqs, self.runs, strict=True)
            if seq.matcher is not None
        ]

    def emit(
        self, result: SampleResult, force: tuple[float, random.Random] | None = None
    ) -> tuple[list[int], list[int], list[int]]:
        """Append each sequence's tokens (accepted drafts, then one more) until one stops it.
        Returns the tokens appended, how many per sequence, and the sequences that stopped.
        ``force``: ``(p, rng)`` keeps each draft with probability ``p`` (``forced_acceptance``)."""
        tokens, counts, stopped = [], [], []
        for seq, run in zip(self.seqs, self.runs, strict=True):
            sampled, emitted = result.token_ids[run], 1
            if len(sampled) > 1:
                drafts = self.drafts[run]
                if force is not None:
                    sampled = _forced(sampled, drafts, *force)
                # The last row's draft is None: some row always differs.
                emitted += next(j for j, (t, d) in enumerate(zip(sampled, drafts, strict=True)) if t != d)
                self.accepted.append(emitted - 1)
                if (state := self.rewind.get(seq.seq_id)) is not None:
                    _redraw(seq.generator, state, emitted)
            n = 0
            for j in range(emitted):
                n += 1
                if seq.append(sampled[j], result.logprobs[run.start + j]):
                    stopped.append(seq.seq_id)
                    break
            tokens.extend(sampled[:n])
            counts.append(n)
        return tokens, counts, stopped


def _forced(sampled: list[int], drafts: list[int | None], p: float, rng: random.Random) -> list[int]:
    """``sampled`` with its leading drafts kept, each with probability ``p``."""
    out = list(sampled)
    for j, d in enumerate(drafts[:-1]):
        if d is None or rng.random() >= p:
            break
        out[j] = d
    return out


def _redraw(generator: torch.Generator | None, state: torch.Tensor, draws: int) -> None:
    """Put ``generator`` back to ``state``, then draw ``draws`` uniforms as the sampler draws a
    seeded row's (``sample.sampling.draw``: one float32 each, on the generator's device)."""
    assert generator is not None
    generator.set_state(state)
    for _ in range(draws):
        torch.rand(1, generator=generator, device=generator.device, dtype=torch.float32)
