"""Sampling parameters (vLLM's names and defaults) and the batched sampler: grammar masks,
penalties, temperature, top-k, top-p, min-p, then greedy or a draw from each request's own
generator, so a seeded request gets the same tokens whatever else is in the batch."""

from __future__ import annotations

import dataclasses
import enum
import functools
import math
from dataclasses import dataclass, field
from typing import Any

import torch

from neo_rs._core import Categorical
from neo_rs.cuda_runtime import runtime
from neo_rs.errors import InvalidArgumentError
from neo_rs.sample.structured import StructuredOutputsParams, TokenMask

MAX_LOGPROBS = 20
# Each generated token is checked against every stop string and id: these bound that work and a
# request's size (OpenAI's API takes at most 4 stop strings).
MAX_STOP_STRINGS = 64
MAX_STOP_CHARS = 1024
MAX_STOP_TOKEN_IDS = 1024
SEED_RANGE = (-(2**63), 2**63 - 1)  # torch.Generator's; vLLM bounds the API's seed the same way


class RequestOutputKind(enum.Enum):
    """What each ``RequestOutput`` of a request carries (vLLM's names): everything so far, only
    what is new since the previous one (a stream's cost then does not grow with its length), or
    nothing until the request finishes."""

    CUMULATIVE = 0
    DELTA = 1
    FINAL_ONLY = 2


@dataclass
class SamplingParams:
    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 or -1: off
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    seed: int | None = None
    max_tokens: int | None = 16  # None: up to the model's context
    min_tokens: int = 0
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    logprobs: int | None = None  # top-n logprobs per output token (the sampled one is always included)
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    logit_bias: dict[int, float] | None = None  # token id -> added to its logit, in [-100, 100]
    output_kind: RequestOutputKind = RequestOutputKind.CUMULATIVE
    structured_outputs: StructuredOutputsParams | None = None  # or its fields as a dict

    def __post_init__(self) -> None:
        if isinstance(self.structured_outputs, dict):
            try:
                self.structured_outputs = StructuredOutputsParams(**self.structured_outputs)
            except TypeError as e:
                raise InvalidArgumentError(f"structured_outputs: {e}") from e
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = list(self.stop or [])
        self.stop_token_ids = list(self.stop_token_ids or [])
        self._validate()

    def _validate(self) -> None:
        def bad(msg: str) -> InvalidArgumentError:
            return InvalidArgumentError(msg)

        def is_int(x: Any) -> bool:
            return isinstance(x, int) and not isinstance(x, bool)

        def is_number(x: Any) -> bool:
            return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)

        if not is_int(self.n) or self.n < 1:
            raise bad(f"n must be a positive integer, got {self.n!r}")
        if not is_number(self.temperature) or self.temperature < 0:
            raise bad(f"temperature must be non-negative, got {self.temperature!r}")
        if not is_number(self.top_p) or not 0 < self.top_p <= 1:
            raise bad(f"top_p must be in (0, 1], got {self.top_p!r}")
        if not is_int(self.top_k) or self.top_k < -1:
            raise bad(f"top_k must be -1, 0 (off) or a positive integer, got {self.top_k!r}")
        if not is_number(self.min_p) or not 0 <= self.min_p <= 1:
            raise bad(f"min_p must be in [0, 1], got {self.min_p!r}")
        if not is_number(self.repetition_penalty) or self.repetition_penalty <= 0:
            raise bad(f"repetition_penalty must be positive, got {self.repetition_penalty!r}")
        for name in ("presence_penalty", "frequency_penalty"):
            v = getattr(self, name)
            if not is_number(v) or not -2 <= v <= 2:
                raise bad(f"{name} must be in [-2, 2], got {v!r}")
        if self.seed is not None and (
            not is_int(self.seed) or not SEED_RANGE[0] <= self.seed <= SEED_RANGE[1]
        ):
            raise bad(f"seed must be an integer in [-2**63, 2**63 - 1], got {self.seed!r}")
        if self.max_tokens is not None and (not is_int(self.max_tokens) or self.max_tokens < 1):
            raise bad(f"max_tokens must be at least 1, got {self.max_tokens!r}")
        if not is_int(self.min_tokens) or self.min_tokens < 0:
            raise bad(f"min_tokens must be non-negative, got {self.min_tokens!r}")
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise bad(f"min_tokens ({self.min_tokens}) must not exceed max_tokens ({self.max_tokens})")
        if not all(isinstance(s, str) and s for s in self.stop):
            raise bad("stop must be a string or a list of non-empty strings")
        if len(self.stop) > MAX_STOP_STRINGS or any(len(s) > MAX_STOP_CHARS for s in self.stop):
            raise bad(
                f"stop holds at most {MAX_STOP_STRINGS} strings of at most {MAX_STOP_CHARS} characters "
                f"(MAX_STOP_STRINGS, MAX_STOP_CHARS); got {len(self.stop)}"
            )
        if not all(is_int(t) and t >= 0 for t in self.stop_token_ids):
            raise bad("stop_token_ids must be non-negative integers")
        if len(self.stop_token_ids) > MAX_STOP_TOKEN_IDS:
            raise bad(
                f"stop_token_ids holds at most {MAX_STOP_TOKEN_IDS} ids (MAX_STOP_TOKEN_IDS); "
                f"got {len(self.stop_token_ids)}"
            )
        if self.logprobs is not None and (
            not is_int(self.logprobs) or not 0 <= self.logprobs <= MAX_LOGPROBS
        ):
            raise bad(f"logprobs must be in [0, {MAX_LOGPROBS}], got {self.logprobs!r}")
        if self.logit_bias is not None and not all(
            is_int(t) and t >= 0 and is_number(b) and -100 <= b <= 100 for t, b in self.logit_bias.items()
        ):
            raise bad("logit_bias must map token ids to biases in [-100, 100]")
        if self.structured_outputs is not None and not isinstance(
            self.structured_outputs, StructuredOutputsParams
        ):
            raise bad("structured_outputs must be a StructuredOutputsParams or a dict of its fields")

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> SamplingParams:
        """Build from a mapping, refusing unknown fields (the server's request bodies)."""
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(d) - known)
        if unknown:
            raise InvalidArgumentError(f"unknown sampling parameter(s): {', '.join(unknown)}")
        return cls(**d)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0 or self.top_k == 1

    @property
    def has_penalties(self) -> bool:
        return self.repetition_penalty != 1 or self.presence_penalty != 0 or self.frequency_penalty != 0


@dataclass
class SampleRow:
    """What the sampler needs of one sequence."""

    params: SamplingParams
    prompt_ids: list[int]
    output_ids: list[int]
    generator: torch.Generator | None
    banned_ids: list[int]  # EOS / stop ids while fewer than min_tokens were generated


@dataclass
class SampleResult:
    token_ids: list[int]
    # Per row: {token_id: logprob} of the sampled token and the top-n, or None.
    logprobs: list[dict[int, float] | None]


def _apply_penalties(logits: torch.Tensor, row: SampleRow) -> None:
    vocab = logits.shape[-1]
    p = row.params
    out = torch.tensor(row.output_ids, dtype=torch.long, device=logits.device)
    # Not bincount: its length depends on the largest id, which a GPU would have to report first.
    counts = torch.zeros(vocab, dtype=logits.dtype, device=logits.device).index_add_(
        0, out, torch.ones(len(out), dtype=logits.dtype, device=logits.device)
    )
    if p.repetition_penalty != 1:
        seen = counts > 0
        seen[torch.tensor(row.prompt_ids, dtype=torch.long, device=logits.device)] = True
        scaled = torch.where(logits > 0, logits / p.repetition_penalty, logits * p.repetition_penalty)
        logits.copy_(torch.where(seen, scaled, logits))
    logits -= p.frequency_penalty * counts + p.presence_penalty * (counts > 0).to(logits.dtype)


def _top_k_top_p(logits: torch.Tensor, ks: list[int], top_ps: list[float]) -> torch.Tensor:
    """Top-k then top-p (over what top-k keeps) by a full sort of each row; dropped -> -inf."""
    dev, vocab = logits.device, logits.shape[-1]
    sorted_logits, order = logits.sort(dim=-1, descending=True)
    k = torch.tensor(ks, device=dev)[:, None].clamp(max=vocab)
    drop = torch.arange(vocab, device=dev)[None, :] >= k
    probs = sorted_logits.masked_fill(drop, float("-inf")).softmax(dim=-1)
    # Keep the smallest prefix whose mass reaches top_p (the first token always stays).
    before = probs.cumsum(dim=-1) - probs
    drop |= before >= torch.tensor(top_ps, device=dev, dtype=probs.dtype)[:, None]
    return logits.scatter(-1, order, sorted_logits.masked_fill(drop, float("-inf")))


def _filter(logits: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
    """Temperature, top-k, top-p and min-p over rows ``[R, V]``; masked entries become -inf."""
    dev = logits.device
    temps = torch.tensor([p.temperature for p in params], device=dev, dtype=logits.dtype)[:, None]
    logits = logits / temps
    vocab = logits.shape[-1]
    ks = [p.top_k if p.top_k > 0 else vocab for p in params]
    top_ps = [p.top_p for p in params]
    rows = [i for i, (k, tp) in enumerate(zip(ks, top_ps, strict=True)) if k < vocab or tp < 1]
    if rows:
        logits[rows] = _top_k_top_p(logits[rows], [ks[i] for i in rows], [top_ps[i] for i in rows])
    if any(p.min_p > 0 for p in params):
        min_ps = torch.tensor([p.min_p for p in params], device=dev, dtype=logits.dtype)[:, None]
        probs = logits.softmax(dim=-1)
        logits = logits.masked_fill(probs < min_ps * probs.max(dim=-1, keepdim=True).values, float("-inf"))
    return logits


def sample(
    logits: torch.Tensor,
    rows: list[SampleRow],
    default_generator: torch.Generator,
    mask: TokenMask | None = None,
) -> SampleResult:
    """Sample one token per row of ``logits`` ``[len(rows), vocab]`` (float32, or the model's dtype,
    widened here unless every row takes its maximum); ``mask``: the tokens the constrained rows'
    grammars allow (logprobs stay those of the model)."""
    tokens, raw_logprobs = draw(logits, rows, default_generator, mask)
    token_list = runtime().read(tokens)
    logprobs: list[dict[int, float] | None] = [None] * len(rows)
    if raw_logprobs is not None:
        _read_logprobs(raw_logprobs, tokens, token_list, rows, logprobs)
    return SampleResult(token_list, logprobs)


def draw(
    logits: torch.Tensor,
    rows: list[SampleRow],
    default_generator: torch.Generator,
    mask: TokenMask | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``sample``'s device work: the tokens drawn, and the rows' log-probabilities when any row
    asks for them (the memory plan runs this alone, ``worker/memory_plan.py``)."""
    if not _maxima_only(rows, mask):
        logits = logits.float()  # exact from the model's dtype; float32 stays as it is
    want_logprobs = [r.params.logprobs is not None for r in rows]
    raw_logprobs = logits.log_softmax(dim=-1) if any(want_logprobs) else None
    if mask is not None:
        dev = logits.device
        logits = logits.index_add(0, mask.index.to(dev), mask.additive.to(dev))
    if any(r.params.has_penalties or r.params.logit_bias or r.banned_ids for r in rows):
        if mask is None:
            logits = logits.clone()
        constrained = set(mask.rows) if mask is not None else set()
        for i, r in enumerate(rows):
            if r.params.has_penalties:
                _apply_penalties(logits[i], r)
            if r.params.logit_bias:
                bias = r.params.logit_bias
                logits[i, list(bias)] += torch.tensor(
                    list(bias.values()), dtype=logits.dtype, device=logits.device
                )
            if r.banned_ids and i not in constrained:
                logits[i, r.banned_ids] = float("-inf")
            elif r.banned_ids:  # EOS waits for min_tokens, unless the grammar allows nothing else
                kept = logits[i].clone()
                kept[r.banned_ids] = float("-inf")
                logits[i] = torch.where(kept.isfinite().any(), kept, logits[i])
    random_rows = [i for i, r in enumerate(rows) if not r.params.greedy]
    if len(random_rows) < len(rows):
        tokens = greedy(logits)
    else:  # every row drawn: no pass over the logits for a maximum no row keeps
        tokens = torch.empty(len(rows), dtype=torch.long, device=logits.device)
    if random_rows:
        params = [rows[i].params for i in random_rows]
        u = _uniforms(rows, random_rows, default_generator, logits.device)
        draw_rows = draw_on_cpu if logits.device.type == "cpu" else draw_in_torch
        tokens[torch.tensor(random_rows, device=logits.device)] = draw_rows(logits, random_rows, params, u)
    return tokens, raw_logprobs


def _maxima_only(rows: list[SampleRow], mask: TokenMask | None) -> bool:
    """Whether every row's token is its largest logit as the model gave it: greedy, no grammar,
    penalty, bias, banned token or logprobs."""
    return mask is None and all(
        r.params.greedy
        and r.params.logprobs is None
        and not (r.params.has_penalties or r.params.logit_bias or r.banned_ids)
        for r in rows
    )


def greedy(logits: torch.Tensor) -> torch.Tensor:
    """Each row's first largest logit, as argmax gives: on the CPU by the Rust kernel, which reads
    bf16 rows as they are (64 rows of a 49k vocabulary: 0.1 ms against torch's 0.9 ms maximum
    after a 0.9 ms float32 copy in the engine)."""
    if logits.device.type == "cpu" and logits.dtype in (torch.float32, torch.bfloat16):
        tokens = _categorical(torch.get_num_threads()).argmax(logits.contiguous())
        return torch.tensor(tokens, dtype=torch.long)
    return logits.max(dim=-1).indices  # the first maximum, as argmax gives


def _uniforms(
    rows: list[SampleRow], random_rows: list[int], default_generator: torch.Generator, device: torch.device
) -> torch.Tensor:
    """One uniform ``[len(random_rows), 1]`` a random row: a seeded row's from its own generator,
    so its tokens do not depend on the batch; the others' from one shared draw."""
    u = torch.empty(len(random_rows), 1, dtype=torch.float32, device=device)
    shared = [j for j, i in enumerate(random_rows) if rows[i].generator is None]
    if shared:
        at = torch.tensor(shared, device=device)
        u[at] = torch.rand(len(shared), 1, generator=default_generator, device=device, dtype=u.dtype)
    for j, i in enumerate(random_rows):
        gen = rows[i].generator
        if gen is not None:
            u[j] = torch.rand(1, generator=gen, device=device, dtype=u.dtype)
    return u


@functools.cache
def _categorical(num_threads: int) -> Categorical:
    return Categorical(num_threads=num_threads)


def draw_in_torch(
    logits: torch.Tensor, random_rows: list[int], params: list[SamplingParams], u: torch.Tensor
) -> torch.Tensor:
    """The tokens of ``random_rows`` drawn at ``u`` (``[rows, 1]``) by the inverse of their CDF
    (torch's multinomial is ~50x slower on the CPU); on CUDA."""
    probs = _filter(logits[torch.tensor(random_rows, device=logits.device)], params).softmax(dim=-1)
    cdf = probs.cumsum(dim=-1)
    return torch.searchsorted(cdf, u * cdf[:, -1:], right=True)[:, 0].clamp_(max=probs.shape[-1] - 1)


def draw_on_cpu(
    logits: torch.Tensor, random_rows: list[int], params: list[SamplingParams], u: torch.Tensor
) -> torch.Tensor:
    """``draw_in_torch``'s tokens by the Rust sampler, which narrows each row to a threshold on
    its logits (top-k and top-p from its largest entries, not a sort of the row) and reads it
    about twice where torch's filters and softmax, cumsum and search read it a dozen times."""
    drawn = _categorical(torch.get_num_threads()).draw(
        logits.contiguous(),
        random_rows,
        [p.temperature for p in params],
        [max(p.top_k, 0) for p in params],
        [p.top_p for p in params],
        [p.min_p for p in params],
        u[:, 0].tolist(),
    )
    return torch.tensor(drawn, dtype=torch.long)


def _read_logprobs(
    raw: torch.Tensor,
    tokens: torch.Tensor,
    token_list: list[int],
    rows: list[SampleRow],
    out: list[dict[int, float] | None],
) -> None:
    """Each asking row's entry in ``out``: the sampled token's logprob and its top-n, read from
    the device in one wait (float64 holds the top-n's token ids exactly)."""
    want = [i for i, r in enumerate(rows) if r.params.logprobs is not None]
    at = torch.tensor(want, device=raw.device)
    lp = raw[at]
    top = lp.topk(max(rows[i].params.logprobs or 0 for i in want), dim=-1)
    k = top.indices.shape[1]
    chosen = lp.gather(1, tokens[at, None])
    packed = torch.cat([chosen.double(), top.indices.double(), top.values.double()], dim=1)
    for i, row in zip(want, runtime().read(packed), strict=True):
        n = rows[i].params.logprobs or 0
        entry = {token_list[i]: row[0]}
        entry.update(zip((int(t) for t in row[1 : 1 + n]), row[1 + k : 1 + k + n], strict=True))
        out[i] = entry
