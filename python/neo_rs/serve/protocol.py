"""The OpenAI wire format (vLLM's flavour): request bodies checked and turned into prompts and
``SamplingParams``, response bodies and stream chunks built from ``RequestOutput``s, and the
OpenAI error body. Everything here is pure; the handlers in ``app.py`` do the I/O."""

from __future__ import annotations

import time
import uuid
from dataclasses import dataclass, field
from typing import Any

from neo_rs.errors import InvalidArgumentError
from neo_rs.sampling import MAX_LOGPROBS, SamplingParams
from neo_rs.sequence import CompletionOutput, RequestOutput


class ApiError(Exception):
    """An HTTP error with an OpenAI error body."""

    def __init__(
        self, status: int, message: str, type_: str = "invalid_request_error", param: str | None = None
    ):
        super().__init__(message)
        self.status, self.message, self.type, self.param = status, message, type_, param

    def body(self) -> dict[str, Any]:
        return {
            "error": {"message": self.message, "type": self.type, "param": self.param, "code": self.status}
        }


def bad(message: str, param: str | None = None) -> ApiError:
    return ApiError(400, message, "invalid_request_error", param)


# Body field -> (accepted Python types, SamplingParams name). Other fields OpenAI clients send
# (user, logit_bias, response_format, ...) are accepted and ignored, as vLLM does.
_NUM = (int, float)
_SAMPLING: dict[str, tuple[tuple[type, ...], str]] = {
    "n": ((int,), "n"),
    "temperature": (_NUM, "temperature"),
    "top_p": (_NUM, "top_p"),
    "top_k": ((int,), "top_k"),
    "min_p": (_NUM, "min_p"),
    "presence_penalty": (_NUM, "presence_penalty"),
    "frequency_penalty": (_NUM, "frequency_penalty"),
    "repetition_penalty": (_NUM, "repetition_penalty"),
    "seed": ((int,), "seed"),
    "min_tokens": ((int,), "min_tokens"),
    "stop_token_ids": ((list,), "stop_token_ids"),
    "ignore_eos": ((bool,), "ignore_eos"),
    "include_stop_str_in_output": ((bool,), "include_stop_str_in_output"),
    "skip_special_tokens": ((bool,), "skip_special_tokens"),
}


def _typed(body: dict[str, Any], name: str, types: tuple[type, ...]) -> Any:
    value = body[name]
    ok = isinstance(value, types) and not (isinstance(value, bool) and bool not in types)
    if not ok:
        want = " or ".join(t.__name__ for t in types)
        raise bad(f"'{name}' must be {want}, got {type(value).__name__}", name)
    return value


def _opt(body: dict[str, Any], name: str, types: tuple[type, ...]) -> Any:
    return None if body.get(name) is None else _typed(body, name, types)


@dataclass
class StreamOptions:
    include_usage: bool = False
    continuous_usage_stats: bool = False


@dataclass
class ParsedRequest:
    """What a handler needs: prompts (text or ids), sampling params and output options."""

    model: str
    prompts: list[str | list[int]]
    params: SamplingParams
    stream: bool
    stream_options: StreamOptions
    echo: bool = False
    logprobs: int | None = None
    messages: list[dict[str, str]] = field(default_factory=list)


def _common(body: Any, served: str, chat: bool) -> tuple[dict[str, Any], str, bool, StreamOptions]:
    if not isinstance(body, dict):
        raise bad("the request body must be a JSON object")
    model = body.get("model")
    if model is not None and not isinstance(model, str):
        raise bad("'model' must be a string", "model")
    if model is not None and model != served:
        raise ApiError(404, f"The model `{model}` does not exist.", "NotFoundError", "model")
    stream = bool(_opt(body, "stream", (bool,)) or False)
    opts = _opt(body, "stream_options", (dict,)) or {}
    if opts and not stream:
        raise bad("'stream_options' is only allowed with 'stream': true", "stream_options")
    so = StreamOptions(
        include_usage=bool(opts.get("include_usage", False)),
        continuous_usage_stats=bool(opts.get("continuous_usage_stats", False)),
    )
    kw: dict[str, Any] = {}
    for name, (types, target) in _SAMPLING.items():
        if body.get(name) is not None:
            kw[target] = _typed(body, name, types)
    stop = body.get("stop")
    if stop is not None:
        if isinstance(stop, str):
            kw["stop"] = [stop]
        elif isinstance(stop, list) and all(isinstance(s, str) for s in stop):
            kw["stop"] = stop
        else:
            raise bad("'stop' must be a string or a list of strings", "stop")
    max_tokens = _opt(body, "max_tokens", (int,))
    if chat:
        completion_tokens = _opt(body, "max_completion_tokens", (int,))
        max_tokens = completion_tokens if completion_tokens is not None else max_tokens
    elif max_tokens is None:
        max_tokens = 16  # the completions API's default
    kw["max_tokens"] = max_tokens
    return kw, served, stream, so


def _params(kw: dict[str, Any]) -> SamplingParams:
    try:
        return SamplingParams(**kw)
    except InvalidArgumentError as e:
        raise bad(str(e)) from e


def parse_completion(body: Any, served: str) -> ParsedRequest:
    kw, model, stream, so = _common(body, served, chat=False)
    prompt = body.get("prompt")
    prompts: list[str | list[int]]
    if isinstance(prompt, str):
        prompts = [prompt]
    elif isinstance(prompt, list) and prompt and all(isinstance(p, str) for p in prompt):
        prompts = list(prompt)
    elif (
        isinstance(prompt, list)
        and prompt
        and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt)
    ):
        prompts = [list(prompt)]
    elif isinstance(prompt, list) and prompt and all(isinstance(p, list) for p in prompt):
        if not all(p and all(isinstance(t, int) and not isinstance(t, bool) for t in p) for p in prompt):
            raise bad("token-id prompts must be non-empty lists of integers", "prompt")
        prompts = [list(p) for p in prompt]
    else:
        raise bad("'prompt' must be a non-empty string, list of strings, or token ids", "prompt")
    if any(isinstance(p, str) and not p for p in prompts):
        raise bad("the prompt is empty", "prompt")
    logprobs = _opt(body, "logprobs", (int,))
    if logprobs is not None and not 0 <= logprobs <= MAX_LOGPROBS:
        raise bad(f"'logprobs' must be in [0, {MAX_LOGPROBS}]", "logprobs")
    echo = bool(_opt(body, "echo", (bool,)) or False)
    if logprobs is not None:
        kw["logprobs"] = logprobs
    return ParsedRequest(model, prompts, _params(kw), stream, so, echo=echo, logprobs=logprobs)


def parse_chat(body: Any, served: str) -> ParsedRequest:
    kw, model, stream, so = _common(body, served, chat=True)
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise bad("'messages' must be a non-empty list", "messages")
    clean = []
    for m in messages:
        if not isinstance(m, dict) or m.get("role") not in ("system", "user", "assistant"):
            raise bad("each message needs a 'role' of system, user or assistant", "messages")
        content = m.get("content")
        if isinstance(content, list):  # content parts: keep the text ones
            content = "".join(
                p.get("text", "") for p in content if isinstance(p, dict) and p.get("type") == "text"
            )
        if not isinstance(content, str):
            raise bad("each message needs a string 'content'", "messages")
        clean.append({"role": m["role"], "content": content})
    logprobs = None
    if _opt(body, "logprobs", (bool,)):
        logprobs = _opt(body, "top_logprobs", (int,)) or 0
        if not 0 <= logprobs <= MAX_LOGPROBS:
            raise bad(f"'top_logprobs' must be in [0, {MAX_LOGPROBS}]", "top_logprobs")
        kw["logprobs"] = logprobs
    elif body.get("top_logprobs") is not None:
        raise bad("'top_logprobs' needs 'logprobs': true", "top_logprobs")
    return ParsedRequest(model, [], _params(kw), stream, so, logprobs=logprobs, messages=clean)


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def usage(prompt_tokens: int, completion_tokens: int) -> dict[str, int]:
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
    }


@dataclass
class Envelope:
    """Fields every response and chunk of one request share."""

    id: str
    model: str
    created: int = field(default_factory=lambda: int(time.time()))

    def wrap(self, obj: str, choices: list[dict[str, Any]], **extra: Any) -> dict[str, Any]:
        return {
            "id": self.id,
            "object": obj,
            "created": self.created,
            "model": self.model,
            "choices": choices,
            **extra,
        }


def completion_logprobs(
    out: CompletionOutput, start: int, end: int, token_text: Any, text_offset: int
) -> dict[str, Any] | None:
    """The completions API's logprobs object for output tokens ``start:end``."""
    if out.logprobs is None:
        return None
    tokens, token_lps, tops, offsets = [], [], [], []
    off = text_offset
    for tok, entry in zip(out.token_ids[start:end], out.logprobs[start:end], strict=True):
        text = token_text(tok)
        tokens.append(text)
        token_lps.append(entry[tok])
        tops.append({token_text(t): lp for t, lp in entry.items()})
        offsets.append(off)
        off += len(text)
    return {"tokens": tokens, "token_logprobs": token_lps, "top_logprobs": tops, "text_offset": offsets}


def chat_logprobs(
    out: CompletionOutput, start: int, end: int, token_text: Any, top_n: int
) -> dict[str, Any] | None:
    if out.logprobs is None:
        return None
    content = []
    for tok, entry in zip(out.token_ids[start:end], out.logprobs[start:end], strict=True):
        text = token_text(tok)
        top = sorted(entry.items(), key=lambda kv: -kv[1])[:top_n]
        content.append(
            {
                "token": text,
                "logprob": entry[tok],
                "bytes": list(text.encode()),
                "top_logprobs": [
                    {"token": token_text(t), "logprob": lp, "bytes": list(token_text(t).encode())}
                    for t, lp in top
                ],
            }
        )
    return {"content": content}


def num_output_tokens(out: RequestOutput) -> int:
    return sum(len(o.token_ids) for o in out.outputs)
