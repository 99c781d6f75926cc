"""One generated sequence (a request has ``n`` of them) and the outputs handed to users: its
tokens and text, stop checks (EOS, stop ids, stop strings, after ``min_tokens``; a completed
grammar), logprobs and timing. Finish reasons and ``stop_reason`` follow vLLM."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

import torch

from neo_rs.engine.tokenizer import IncrementalDetokenizer
from neo_rs.sample.sampling import RequestOutputKind, SampleRow, SamplingParams
from neo_rs.sample.structured import advance


@dataclass
class CompletionOutput:
    """One sequence's output: all of it, or (``RequestOutputKind.DELTA``) what is new since the
    request's previous output."""

    index: int
    text: str
    token_ids: list[int]
    finish_reason: str | None  # stop | length | abort
    stop_reason: int | str | None  # the stop token id or string that ended it
    logprobs: list[dict[int, float]] | None
    cumulative_logprob: float | None


@dataclass
class RequestMetrics:
    """Monotonic-clock times of a request's life, and how many tokens it generated."""

    arrival_time: float
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    finished_time: float | None = None
    num_generation_tokens: int = 0  # all its sequences' tokens, set when it finishes


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    metrics: RequestMetrics
    num_cached_tokens: int = 0  # prompt tokens found in the prefix cache (vLLM's)


@dataclass
class Sequence:
    seq_id: int  # the scheduler's request id
    index: int  # which of the request's n outputs
    params: SamplingParams
    prompt_ids: list[int]
    eos_ids: set[int]
    generator: torch.Generator | None
    detokenizer: IncrementalDetokenizer | None
    matcher: Any | None = None  # the llguidance matcher of its structured output
    output_ids: list[int] = field(default_factory=list)
    text: str = ""
    logprobs: list[dict[int, float]] | None = None
    cumulative_logprob: float = 0.0
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    first_token_time: float | None = None
    # How much of the text and tokens DELTA outputs have handed out.
    sent_chars: int = 0
    sent_tokens: int = 0

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    def token_ids(self) -> list[int]:
        """The prompt, then the outputs so far."""
        return self.prompt_ids + self.output_ids

    def sample_row(self, drafts: list[int] | None = None) -> SampleRow:
        """What the sampler needs for the token after the outputs so far, and after ``drafts``
        (tokens being verified) if given."""
        outputs = self.output_ids + drafts if drafts else self.output_ids
        banned: list[int] = []
        if len(outputs) < self.params.min_tokens:
            banned = self.params.stop_token_ids + ([] if self.params.ignore_eos else sorted(self.eos_ids))
        return SampleRow(self.params, self.prompt_ids, outputs, self.generator, banned)

    def append(self, token: int, logprobs: dict[int, float] | None) -> bool:
        """Add a sampled token; True when it stops the sequence (the caller tells the scheduler)."""
        if self.first_token_time is None:
            self.first_token_time = time.monotonic()
        self.output_ids.append(token)
        if logprobs is not None:
            if self.logprobs is None:
                self.logprobs = []
            self.logprobs.append(logprobs)
            self.cumulative_logprob += logprobs[token]
        delta = self.detokenizer.add(token) if self.detokenizer else ""
        self.text += delta
        if self.matcher is not None and advance(self.matcher, token):
            return True  # the grammar is complete: nothing may follow
        p = self.params
        if len(self.output_ids) < p.min_tokens:
            return False
        if token in p.stop_token_ids:
            self.stop_reason = token
            return True
        if not p.ignore_eos and token in self.eos_ids:
            return True
        if p.stop and delta:
            return self._find_stop_string(len(delta))
        return False

    def _find_stop_string(self, delta_len: int) -> bool:
        longest = max(len(s) for s in self.params.stop)
        start = max(0, len(self.text) - delta_len - longest + 1)
        hits = [(i, s) for s in self.params.stop if (i := self.text.find(s, start)) >= 0]
        if not hits:
            return False
        at, stop = min(hits)
        self.text = self.text[: at + len(stop)] if self.params.include_stop_str_in_output else self.text[:at]
        self.stop_reason = stop
        return True

    def output(self, kind: RequestOutputKind = RequestOutputKind.CUMULATIVE) -> CompletionOutput:
        if kind is not RequestOutputKind.DELTA:
            return self._output(self.text, list(self.output_ids), self.logprobs)
        # Text that may still turn out to start a stop string is held back until it cannot (a
        # stop cuts the text there, never before what was held back).
        holdback = max((len(s) for s in self.params.stop), default=1) - 1
        upto = len(self.text) if self.finished else max(self.sent_chars, len(self.text) - holdback)
        text, self.sent_chars = self.text[self.sent_chars : upto], upto
        first, self.sent_tokens = self.sent_tokens, len(self.output_ids)
        logprobs = self.logprobs[first:] if self.logprobs is not None else None
        return self._output(text, self.output_ids[first:], logprobs)

    def _output(
        self, text: str, token_ids: list[int], logprobs: list[dict[int, float]] | None
    ) -> CompletionOutput:
        return CompletionOutput(
            index=self.index,
            text=text,
            token_ids=token_ids,
            finish_reason=self.finish_reason,
            stop_reason=self.stop_reason,
            logprobs=logprobs,
            cumulative_logprob=self.cumulative_logprob if self.logprobs is not None else None,
        )
