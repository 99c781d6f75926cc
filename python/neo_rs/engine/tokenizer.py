"""Tokenizer loading (local files only, via transformers), EOS ids, and incremental
detokenization that never emits half a UTF-8 character."""

from __future__ import annotations

import json
import logging
from collections import deque
from collections.abc import Callable
from pathlib import Path
from typing import Any

from tokenizers import Tokenizer
from tokenizers.decoders import DecodeStream

from neo_rs.errors import ModelLoadError

log = logging.getLogger(__name__)

# Prompt tokens kept as left context so the first output token decodes with the right spacing.
_CONTEXT_TOKENS = 5
# Tokens held back at most while they decode to nothing new or to half a character. A UTF-8
# character spans at most 4 bytes (so at most 4 byte tokens); a longer run is invalid bytes or
# skipped special tokens, and waiting on would make each token's decode cost grow with the run.
MAX_PENDING_TOKENS = 6


def load_tokenizer(model_dir: str | Path) -> Any:
    from transformers import AutoTokenizer  # heavy import, only when a tokenizer is needed

    try:
        return AutoTokenizer.from_pretrained(str(model_dir), local_files_only=True)
    except (OSError, ValueError) as e:
        raise ModelLoadError(f"{model_dir}: cannot load the tokenizer ({e})") from e


def _ids(value: Any) -> set[int]:
    if value is None:
        return set()
    if isinstance(value, int):
        return {value}
    return {int(v) for v in value}


def eos_token_ids(model_dir: str | Path, tokenizer: Any | None) -> set[int]:
    """EOS ids from generation_config.json, config.json and the tokenizer, together."""
    ids: set[int] = set()
    for name in ("generation_config.json", "config.json"):
        path = Path(model_dir) / name
        if path.is_file():
            ids |= _ids(json.loads(path.read_text()).get("eos_token_id"))
    if tokenizer is not None:
        ids |= _ids(tokenizer.eos_token_id)
    return ids


class IncrementalDetokenizer:
    """Decodes a growing token list into text deltas. A token is held back while the tokens since
    the last delta decode to no more text, or to text that ends in U+FFFD (an incomplete UTF-8
    sequence). A fast tokenizer steps ``tokenizers``' ``DecodeStream``, which keeps that window in
    Rust and decodes it once a token (decoding it before and after each token from Python took
    six times as long: 0.40 against 0.06 ms for 64 sequences' tokens); others step
    ``_WindowStream``, the same rule in Python. After ``MAX_PENDING_TOKENS`` held back, or where
    the stream fails (a decoder whose text shrinks as tokens arrive), the held tokens' text comes
    out as it is and the stream starts again after them."""

    def __init__(self, tokenizer: Any, prompt_ids: list[int], skip_special_tokens: bool) -> None:
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self.backend: Any = getattr(tokenizer, "backend_tokenizer", None)
        # transformers' decode also takes out spaces before punctuation where a tokenizer asks
        # (WordPiece's); DecodeStream would not, so such a tokenizer keeps the Python stream.
        cleans_up = getattr(tokenizer, "clean_up_tokenization_spaces", False)
        self.fast = isinstance(self.backend, Tokenizer) and not cleans_up
        # The held tokens and the few before them, which decode them with the right spacing.
        self.recent = deque(prompt_ids[-_CONTEXT_TOKENS:], maxlen=_CONTEXT_TOKENS + MAX_PENDING_TOKENS)
        self.held = 0
        self.stream = self._restart()

    def _restart(self) -> DecodeStream | _WindowStream:
        ids = list(self.recent)[-_CONTEXT_TOKENS:]
        # DecodeStream takes context whose text ends in U+FFFD for text still to give (it would
        # give it again); such context (flushed invalid bytes) goes to the Python stream until
        # its next delta.
        if self.fast and not self._decode(ids).endswith("\ufffd"):
            return DecodeStream(ids, self.skip_special_tokens)
        return _WindowStream(self._decode, ids)

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=self.skip_special_tokens)

    def add(self, token_id: int) -> str:
        self.recent.append(token_id)
        self.held += 1
        try:
            text = self.stream.step(self.backend, token_id)
            failed = False
        except Exception:  # tokenizers' "Invalid prefix": the window decoded to less than before
            text, failed = None, True
        if text is None:
            if self.held < MAX_PENDING_TOKENS and not failed:
                return ""
            window = list(self.recent)
            text = self._decode(window)[len(self._decode(window[: -self.held])) :]
            self.stream = self._restart()
        elif self.fast and isinstance(self.stream, _WindowStream):
            self.stream = self._restart()  # the context ends in whole characters again
        self.held = 0
        return text


class _WindowStream:
    """``DecodeStream``'s rule for a tokenizer without a ``tokenizers`` backend: the tokens since
    the last delta's start are decoded with and without the newest ones."""

    def __init__(self, decode: Callable[[list[int]], str], ids: list[int]) -> None:
        self.decode = decode
        self.ids = list(ids)
        self.read = len(self.ids)  # ids[:read] decode to ``prefix``, text already given
        self.prefix = decode(self.ids)

    def step(self, _backend: None, token_id: int) -> str | None:
        self.ids.append(token_id)
        full = self.decode(self.ids)
        if len(full) <= len(self.prefix) or full.endswith("\ufffd"):
            return None
        text = full[len(self.prefix) :]
        del self.ids[: self.read]  # the tokens of this delta are the next one's context
        self.read = len(self.ids)
        self.prefix = self.decode(self.ids)
        return text
