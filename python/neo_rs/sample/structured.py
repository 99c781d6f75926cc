"""Structured outputs (vLLM's ``StructuredOutputsParams``): a JSON Schema, any JSON object, a
regex, a choice of strings, or a Lark/GBNF grammar, compiled by llguidance into a matcher per
sequence. Each step the matchers' token masks are computed on a worker thread while the model
runs (llguidance drops the GIL and fills the rows in parallel), a row per draft for a sequence
verifying drafts; the sampler then applies them before temperature, top-k and top-p, and each
token kept advances its matcher."""

from __future__ import annotations

import json
import threading
from collections import OrderedDict
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import llguidance
import numpy as np
import torch

from neo_rs.errors import BackendError, InvalidArgumentError

if TYPE_CHECKING:
    from llguidance._lib import JsonCompileOptions  # a TypedDict of the stubs only

# JSON is generated compact but readable, with Python's separators and no free whitespace: a
# model may not pad it forever, and every token goes to content. (vLLM lets whitespace in.)
JSON_OPTIONS: JsonCompileOptions = {
    "whitespace_flexible": False,
    "item_separator": ", ",
    "key_separator": ": ",
}
# Compiled grammars kept (by source) for the next request that sends the same one.
CACHED_GRAMMARS = 64


@dataclass
class StructuredOutputsParams:
    """Exactly one of: ``json`` (a JSON Schema, as a dict or its text), ``regex``, ``choice`` (a
    list of strings), ``grammar`` (Lark, or llama.cpp's GBNF), ``json_object=True`` (any object)."""

    json: dict[str, Any] | str | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None

    def __post_init__(self) -> None:
        given = [k for k in ("json", "regex", "choice", "grammar") if getattr(self, k) is not None]
        given += ["json_object"] if self.json_object else []
        if len(given) != 1:
            raise InvalidArgumentError(
                "structured outputs need exactly one of json, regex, choice, grammar or json_object"
                + (f" (got {', '.join(given)})" if given else "")
            )
        if isinstance(self.json, str):
            try:
                self.json = json.loads(self.json)
            except ValueError as e:
                raise InvalidArgumentError(f"the JSON schema is not valid JSON: {e}") from e
        if self.json is not None and not isinstance(self.json, dict):
            raise InvalidArgumentError("the JSON schema must be a JSON object")
        for name in ("regex", "grammar"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, str) or not value):
                raise InvalidArgumentError(f"the {name} must be a non-empty string")
        if self.choice is not None and (
            not isinstance(self.choice, list)
            or not self.choice
            or not all(isinstance(c, str) for c in self.choice)
        ):
            raise InvalidArgumentError("choice must be a non-empty list of strings")

    @property
    def kind(self) -> str:
        """Which one was given (``json={}``, any JSON value, counts)."""
        given = (k for k in ("json", "regex", "choice", "grammar") if getattr(self, k) is not None)
        return next(given, "json_object")

    def source(self) -> str:
        """The llguidance grammar text; raises ``InvalidArgumentError`` if it cannot be built."""
        try:
            if self.json is not None or self.json_object:
                schema = self.json if self.json is not None else {"type": "object"}
                return str(llguidance.LLMatcher.grammar_from_json_schema(schema, defaults=JSON_OPTIONS))
            if self.regex is not None:
                return llguidance.grammar_from("regex", self.regex)
            if self.choice is not None:
                return llguidance.grammar_from("choice", self.choice)  # type: ignore[arg-type]
            assert self.grammar is not None
            return llguidance.grammar_from("grammar", self.grammar)
        except ValueError as e:
            raise InvalidArgumentError(f"cannot compile the {self.kind}: {e}") from e


@dataclass
class TokenMask:
    """What the constrained ``rows`` of a batch may take: ``additive[j]`` is 0 for the tokens row
    ``rows[j]``'s grammar allows and -inf for the rest (added to its logits)."""

    rows: list[int]
    index: torch.Tensor  # ``rows`` as a tensor
    additive: torch.Tensor  # float32 [len(rows), vocab], on the host


# For each byte of llguidance's bitmask, its 8 tokens' additive mask (bit b, little-endian: 0
# where set, -inf where not).
_BYTE_BITS = (np.arange(256)[:, None] >> np.arange(8)) & 1
BYTE_TABLE = np.where(_BYTE_BITS == 1, np.float32(0), np.float32(-np.inf)).astype(np.float32)


def additive_mask(bitmask: np.ndarray, vocab: int) -> np.ndarray:
    """llguidance's int32 bitmask ``[R, ceil(V/32)]`` (bit b of little-endian word w allows token
    32w+b) as float32 ``[R, vocab]``, 0 where allowed and -inf where not."""
    rows = bitmask.shape[0]
    return np.take(BYTE_TABLE, bitmask.view(np.uint8).reshape(-1), axis=0).reshape(rows, -1)[:, :vocab]


class Grammars:
    """Compiles requests' structured outputs into matchers and computes each step's masks.

    The server compiles on its tokenizer threads (to answer a bad schema with a 400 before the
    stream starts) and the engine thread compiles again from the cache, so the cache is locked.
    ``active`` counts the matchers handed out and not yet released."""

    def __init__(self, tokenizer: Any, vocab_size: int, eos_ids: set[int]) -> None:
        self._hf_tokenizer = tokenizer
        self.vocab_size = vocab_size
        self._eos = sorted(eos_ids)
        self._lock = threading.Lock()
        self._tokenizer: llguidance.LLTokenizer | None = None  # built on first use (~0.4 s)
        self._cache: OrderedDict[str, llguidance.LLMatcher] = OrderedDict()
        self._worker: ThreadPoolExecutor | None = None
        self._executor: llguidance.LLExecutor | None = None
        self.active = 0
        self.masks_started = 0

    def _ll_tokenizer(self) -> llguidance.LLTokenizer:
        if self._tokenizer is None:
            import llguidance.hf  # imports transformers: only once a request is constrained

            try:
                self._tokenizer = llguidance.hf.from_tokenizer(
                    self._hf_tokenizer, n_vocab=self.vocab_size, eos_token=self._eos
                )
            except ValueError as e:
                raise InvalidArgumentError(f"structured outputs need a fast tokenizer: {e}") from e
        return self._tokenizer

    def compile(self, params: StructuredOutputsParams) -> llguidance.LLMatcher:
        """A matcher at the start of the grammar; raises ``InvalidArgumentError`` naming the problem."""
        source = params.source()
        with self._lock:
            template = self._cache.get(source)
            if template is None:
                template = llguidance.LLMatcher(self._ll_tokenizer(), source, log_level=0)
                if template.is_error():
                    raise InvalidArgumentError(f"cannot compile the {params.kind}: {template.get_error()}")
                self._cache[source] = template
                while len(self._cache) > CACHED_GRAMMARS:
                    self._cache.popitem(last=False)
            self._cache.move_to_end(source)
            return template.deep_copy()

    def acquire(self, params: StructuredOutputsParams, n: int) -> list[llguidance.LLMatcher]:
        """``n`` matchers from one ``compile`` (which raises before any is taken), each counted in
        ``active`` until ``release``."""
        first = self.compile(params)
        matchers = [first] + [first.deep_copy() for _ in range(n - 1)]
        self.active += n
        return matchers

    def release(self) -> None:
        self.active -= 1

    def close(self) -> None:
        """Stop the mask worker and drop llguidance's executor (their threads end with them)."""
        if self._worker is not None:
            self._worker.shutdown(wait=True)
            self._worker = None
        self._executor = None

    def start_masks(
        self, runs: list[tuple[llguidance.LLMatcher, int, list[int]]]
    ) -> Future[TokenMask] | None:
        """Begin computing the masks of constrained sequences' rows (None if there are none):
        ``(matcher, first row, drafts)`` each, whose rows are the first row and one per draft,
        row ``j`` masked as the grammar stands after drafts ``1..j``."""
        if not runs:
            return None
        if self._worker is None:
            self._worker = ThreadPoolExecutor(1, thread_name_prefix="neo-grammar")
        self.masks_started += 1
        rows: list[int] = []
        triples: list[tuple[Any, int, list[int]]] = []
        for matcher, first, drafts in runs:
            triples.append((matcher, len(rows), drafts))
            rows.extend(range(first, first + len(drafts) + 1))
        return self._worker.submit(self._masks, rows, triples)

    def _masks(self, rows: list[int], triples: list[tuple[Any, int, list[int]]]) -> TokenMask:
        if self._executor is None:  # its threads start with the first constrained request
            self._executor = llguidance.LLExecutor()
        # Rows after a draft the grammar refuses are left allowing everything: that draft is
        # masked out of the row before, so it is rejected and no later row's token is kept.
        bitmask = np.full((len(rows), (self.vocab_size + 31) // 32), -1, dtype=np.int32)
        # (llguidance.torch's fill_next_token_bitmask_par, whose module would pull in torch.compile;
        # a matcher with drafts goes through them and back)
        at, row_bytes = bitmask.ctypes.data, bitmask.shape[1] * 4
        plain = [(m, k) for m, k, drafts in triples if not drafts]
        if plain:
            self._executor.unsafe_compute_mask_ptr(plain, at, row_bytes, len(rows))
        if drafted := [t for t in triples if t[2]]:
            self._executor.unsafe_compute_mask_ptr_with_draft_token(drafted, at, row_bytes, len(rows))
        # Expanded here too, off the critical path, in numpy: a torch op on this thread would
        # start a second OpenMP team, whose spinning threads slow the model's own.
        additive = torch.from_numpy(additive_mask(bitmask, self.vocab_size))
        return TokenMask(rows, torch.tensor(rows), additive)


def advance(matcher: llguidance.LLMatcher, token: int) -> bool:
    """Feed a sampled token to its matcher; True when the grammar is complete (nothing may follow)."""
    if not matcher.consume_token(token):
        # The mask let only tokens the matcher accepts through: this is a bug, and fails the step.
        raise BackendError(f"token {token} broke the grammar: {matcher.get_error()}")
    return bool(matcher.is_stopped())
