"""Tokenizer loading (local files only, via transformers), EOS ids, and incremental
detokenization that never emits half a UTF-8 character."""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

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
    """Decodes a growing token list into text deltas. Text is only emitted once the window decodes
    to more than before and does not end in U+FFFD (an incomplete UTF-8 sequence)."""

    def __init__(self, tokenizer: Any, prompt_ids: list[int], skip_special_tokens: bool) -> None:
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self.tokens = list(prompt_ids[-_CONTEXT_TOKENS:])
        self.prefix_offset = 0
        self.read_offset = len(self.tokens)

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=self.skip_special_tokens)

    def add(self, token_id: int) -> str:
        self.tokens.append(token_id)
        prefix = self._decode(self.tokens[self.prefix_offset : self.read_offset])
        full = self._decode(self.tokens[self.prefix_offset :])
        overdue = len(self.tokens) - self.read_offset >= MAX_PENDING_TOKENS
        if overdue or (len(full) > len(prefix) and not full.endswith("\ufffd")):
            self.prefix_offset, self.read_offset = self.read_offset, len(self.tokens)
            return full[len(prefix) :]
        return ""
