"""Speculative decoding's settings, vLLM's ``--speculative-config`` JSON (``LLM(speculative_config=
...)`` takes the same dict). Prompt lookup (``"method": "ngram"``) drafts from each request's own
tokens, in the Rust scheduler; a draft model (``"method": "draft_model", "model": PATH``) runs
in the engine (``engine/draft_model.py``). The forward pass verifies the drafts wherever the
request's KV lives, the device pool or the host pool (``engine/speculation.py``)."""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any, TypeGuard

from neo_rs._core import MAX_SPECULATIVE_TOKENS
from neo_rs.errors import InvalidArgumentError

# vLLM's when neither bound is given.
DEFAULT_PROMPT_LOOKUP = 5
_FIELDS = ("method", "model", "num_speculative_tokens", "prompt_lookup_min", "prompt_lookup_max")
_LOOKUP = ("prompt_lookup_min", "prompt_lookup_max")
_METHODS = ("ngram", "draft_model")
# Methods vLLM names that this engine does not run (yet): said so, not taken for a typo.
_NOT_SUPPORTED = ("eagle", "eagle3", "medusa", "mlp_speculator", "mtp", "suffix")


@dataclass(frozen=True)
class SpeculativeConfig:
    method: str
    num_speculative_tokens: int
    prompt_lookup_min: int = DEFAULT_PROMPT_LOOKUP
    prompt_lookup_max: int = DEFAULT_PROMPT_LOOKUP
    model: str | None = None  # the draft model (``draft_model``): a directory, .gguf or name

    @staticmethod
    def parse(value: SpeculativeConfig | dict[str, Any] | str) -> SpeculativeConfig:
        """From the dict (or its JSON text); ``InvalidArgumentError`` naming the field at fault."""
        if isinstance(value, SpeculativeConfig):
            return value
        if isinstance(value, str):
            try:
                value = json.loads(value)
            except json.JSONDecodeError as e:
                raise InvalidArgumentError(f"speculative_config is not valid JSON: {e}") from e
        if not isinstance(value, dict):
            raise InvalidArgumentError("speculative_config must be a JSON object")
        unknown = sorted(set(value) - set(_FIELDS))
        if unknown:
            raise InvalidArgumentError(f"speculative_config: unknown field(s) {', '.join(unknown)}")
        # As vLLM: a model without a method is a draft model.
        method = value.get("method", "draft_model" if "model" in value else None)
        if method in _NOT_SUPPORTED:
            raise InvalidArgumentError(
                f"speculative_config.method {method!r} is not supported; use 'ngram' or 'draft_model'"
            )
        if method not in _METHODS:
            raise InvalidArgumentError(
                f"speculative_config.method must be 'ngram' or 'draft_model', got {method!r}"
            )
        k = value.get("num_speculative_tokens")
        if not _is_int(k) or not 1 <= k <= MAX_SPECULATIVE_TOKENS:
            raise InvalidArgumentError(
                "speculative_config.num_speculative_tokens must be an integer in "
                f"1..{MAX_SPECULATIVE_TOKENS}, got {k!r}"
            )
        if method == "draft_model":
            return SpeculativeConfig(method, k, model=_draft_model(value))
        if "model" in value:
            raise InvalidArgumentError("speculative_config.model applies to method 'draft_model' only")
        lo, hi = value.get("prompt_lookup_min"), value.get("prompt_lookup_max")
        lo = lo if lo is not None else hi if hi is not None else DEFAULT_PROMPT_LOOKUP
        hi = hi if hi is not None else lo
        for name, v in (("prompt_lookup_min", lo), ("prompt_lookup_max", hi)):
            if not _is_int(v) or v < 1:
                raise InvalidArgumentError(f"speculative_config.{name} must be a positive integer, got {v!r}")
        if lo > hi:
            raise InvalidArgumentError(
                f"speculative_config.prompt_lookup_min ({lo}) exceeds prompt_lookup_max ({hi})"
            )
        return SpeculativeConfig(method, k, lo, hi)

    def scheduler_args(self, always: bool = False) -> tuple[int, tuple[int, int] | None, bool]:
        """The Rust scheduler's ``speculation`` argument: ``k``, the lookup bounds (None: a draft
        model), and ``always`` (``force_speculation()``)."""
        lookup = (self.prompt_lookup_min, self.prompt_lookup_max) if self.method == "ngram" else None
        return (self.num_speculative_tokens, lookup, always)


def _draft_model(value: dict[str, Any]) -> str:
    given = [f for f in _LOOKUP if f in value]
    if given:
        raise InvalidArgumentError(f"speculative_config.{given[0]} applies to method 'ngram' only")
    model = value.get("model")
    if not isinstance(model, str) or not model:
        raise InvalidArgumentError(
            "speculative_config.model (the draft model's directory or name) is required for 'draft_model'"
        )
    return model


def _is_int(x: Any) -> TypeGuard[int]:
    return isinstance(x, int) and not isinstance(x, bool)
