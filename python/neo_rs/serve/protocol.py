"""The OpenAI wire format (vLLM's flavour): request bodies validated against pydantic models of the
OpenAI request types and turned into prompts and ``SamplingParams``, response bodies and stream
chunks built from ``RequestOutput``s, and the OpenAI error body. Everything here is pure; the
handlers in ``app.py`` do the I/O."""

from __future__ import annotations

import json
import time
import uuid
from dataclasses import dataclass, field
from typing import Annotated, Any, Literal, TypeVar

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from neo_rs.engine.sequence import CompletionOutput, RequestOutput
from neo_rs.errors import InvalidArgumentError
from neo_rs.sample.sampling import MAX_LOGPROBS, RequestOutputKind, SamplingParams
from neo_rs.sample.structured import StructuredOutputsParams
from neo_rs.serve.tools import ToolChoice


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


class _Strict(BaseModel):
    """JSON types exactly (no "5" for 5, no true for 1), finite numbers, and no field we do not
    implement: an unknown field is a 400 that names it, never silently ignored."""

    model_config = ConfigDict(extra="forbid", strict=True, allow_inf_nan=False)


class _StreamOptions(_Strict):
    include_usage: bool = False
    continuous_usage_stats: bool = False


class _JsonSchemaFormat(_Strict):
    name: str
    description: str | None = None
    schema_: dict[str, Any] | None = Field(default=None, alias="schema")
    strict: bool | None = None  # our schemas are always enforced


class _ResponseFormat(_Strict):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: _JsonSchemaFormat | None = None


class _StructuredOutputs(_Strict):
    """vLLM's ``structured_outputs`` (v0.11 on): one field, checked by ``StructuredOutputsParams``."""

    json_: dict[str, Any] | str | None = Field(default=None, alias="json")
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None


# vLLM's older spellings of the same (``guided_json`` is ``structured_outputs.json``, ...).
_GUIDED = ("guided_json", "guided_regex", "guided_choice", "guided_grammar")


class _Sampling(_Strict):
    """Fields both endpoints share; their ranges are ``SamplingParams``' to check."""

    model: str | None = None
    stream: bool = False
    stream_options: _StreamOptions | None = None
    n: int = 1
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    repetition_penalty: float | None = None
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool | None = None
    min_tokens: int | None = None
    include_stop_str_in_output: bool | None = None
    skip_special_tokens: bool | None = None
    logit_bias: dict[str, float] | None = None
    max_tokens: int | None = Field(default=None, ge=1)
    user: str | None = None  # an end-user id for the caller's own logs; no effect here
    # vLLM's: prefix-cache blocks are shared only between requests of the same salt.
    cache_salt: str | None = None
    response_format: _ResponseFormat | None = None
    structured_outputs: _StructuredOutputs | None = None
    guided_json: dict[str, Any] | str | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None

    def structured(self) -> tuple[StructuredOutputsParams | None, str | None]:
        """The request's structured output, if any, and the field that asked for it."""
        asked: list[tuple[str, dict[str, Any]]] = []
        fmt = self.response_format
        if fmt is not None and fmt.type == "json_object":
            asked.append(("response_format", {"json_object": True}))
        elif fmt is not None and fmt.type == "json_schema":
            if fmt.json_schema is None or fmt.json_schema.schema_ is None:
                raise bad(
                    "'response_format' of type json_schema needs 'json_schema.schema'", "response_format"
                )
            asked.append(("response_format", {"json": fmt.json_schema.schema_}))
        if self.structured_outputs is not None:
            asked.append(
                ("structured_outputs", self.structured_outputs.model_dump(by_alias=True, exclude_none=True))
            )
        asked += [
            (name, {name[len("guided_") :]: v}) for name in _GUIDED if (v := getattr(self, name)) is not None
        ]
        if not asked:
            return None, None
        if len(asked) > 1:
            names = ", ".join(f"'{name}'" for name, _ in asked)
            raise bad(f"a request may constrain its output once; it gave {names}", asked[1][0])
        name, fields = asked[0]
        try:
            return StructuredOutputsParams(**fields), name
        except InvalidArgumentError as e:
            raise bad(f"'{name}': {e}", name) from e

    def sampling_kwargs(self) -> dict[str, Any]:
        kw = {k: v for k, v in self.model_dump(include=_SAMPLING_FIELDS).items() if v is not None}
        if self.logit_bias is not None:
            try:
                kw["logit_bias"] = {int(k): v for k, v in self.logit_bias.items()}
            except ValueError as e:
                raise bad("'logit_bias' keys must be token ids", "logit_bias") from e
        return kw


# The fields that pass straight through to ``SamplingParams``.
_SAMPLING_FIELDS = set(_Sampling.model_fields) - {
    "model",
    "stream",
    "stream_options",
    "user",
    "logit_bias",
    "cache_salt",
    "response_format",
    "structured_outputs",
    *_GUIDED,
}


class CompletionBody(_Sampling):
    prompt: str | list[str] | list[int] | list[list[int]]
    logprobs: int | None = None
    echo: bool = False


class _TextPart(_Strict):
    type: Literal["text"]
    text: str


class _CalledFunction(_Strict):
    name: str
    arguments: str  # JSON text, as OpenAI sends it


class _ToolCall(_Strict):
    id: str
    type: Literal["function"]
    function: _CalledFunction


class _Message(_Strict):
    """What every role's message shares. The roles are separate models so that /openapi.json
    states their rules (which fields each role takes, which it needs) and a client or a fuzzer
    can read them."""

    role: str
    content: str | list[_TextPart] | None

    def text(self) -> str:
        if self.content is None:
            return ""
        return self.content if isinstance(self.content, str) else "".join(p.text for p in self.content)

    def for_template(self) -> dict[str, Any]:
        """The message as chat templates expect it."""
        return {"role": self.role, "content": self.text()}


class _TextMessage(_Message):
    content: str | list[_TextPart]


class _SystemMessage(_TextMessage):
    role: Literal["system"]


class _UserMessage(_TextMessage):
    role: Literal["user"]


class _ToolMessage(_TextMessage):
    role: Literal["tool"]
    tool_call_id: str  # the call it answers

    def for_template(self) -> dict[str, Any]:
        return {**super().for_template(), "tool_call_id": self.tool_call_id}


class _AssistantMessage(_Message):
    role: Literal["assistant"]
    content: str | list[_TextPart] | None = None  # None only beside tool calls
    tool_calls: list[_ToolCall] | None = None  # its earlier calls

    def for_template(self) -> dict[str, Any]:
        """Calls' arguments as dicts, as vLLM passes them to templates."""
        if self.content is None and not self.tool_calls:
            raise bad("an assistant message needs 'content' or 'tool_calls'", "messages")
        msg = super().for_template()
        if self.tool_calls:
            calls = []
            for c in self.tool_calls:
                try:
                    args = json.loads(c.function.arguments)
                except ValueError as e:
                    raise bad(f"tool call {c.id!r}: 'arguments' is not JSON", "messages") from e
                calls.append(
                    {"id": c.id, "type": "function", "function": {"name": c.function.name, "arguments": args}}
                )
            msg["tool_calls"] = calls
        return msg


_AnyMessage = Annotated[
    _SystemMessage | _UserMessage | _AssistantMessage | _ToolMessage, Field(discriminator="role")
]


class _FunctionDef(_Strict):
    name: str = Field(pattern=r"^[a-zA-Z0-9_-]{1,64}$")
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None  # the arguments always follow the schema under required / named


class _Tool(_Strict):
    type: Literal["function"]
    function: _FunctionDef


class _FunctionName(_Strict):
    name: str


class _NamedToolChoice(_Strict):
    type: Literal["function"]
    function: _FunctionName


class ChatBody(_Sampling):
    messages: list[_AnyMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(default=None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = None
    tools: list[_Tool] | None = None
    tool_choice: Literal["none", "auto", "required"] | _NamedToolChoice | None = None
    parallel_tool_calls: bool = True

    def tool_choice_of(self) -> ToolChoice | None:
        if self.tools is None:
            if self.tool_choice not in (None, "none"):
                raise bad("'tool_choice' needs 'tools'", "tool_choice")
            return None
        if not self.tools:
            raise bad("'tools' must not be empty", "tools")
        names = [t.function.name for t in self.tools]
        if len(set(names)) != len(names):
            raise bad("tool names must be unique", "tools")
        tools = [t.model_dump(exclude_none=True) for t in self.tools]
        choice = self.tool_choice or "auto"  # OpenAI's default when tools are given
        if isinstance(choice, _NamedToolChoice):
            if choice.function.name not in names:
                raise bad(
                    f"'tool_choice' names {choice.function.name!r}, which is not in 'tools'", "tool_choice"
                )
            return ToolChoice("named", tools, choice.function.name, self.parallel_tool_calls)
        return ToolChoice(choice, tools, None, self.parallel_tool_calls)


# What a type error on these fields says (pydantic's own words name the union's branches).
_SHAPES = {
    "prompt": "'prompt' must be a non-empty string, list of strings, or token ids",
    "messages": "each message needs a 'role' of system, user, assistant or tool and a string (or text "
    "parts) 'content'; assistant messages may carry 'tool_calls', tool messages a 'tool_call_id'",
}


_B = TypeVar("_B", bound=_Strict)


def _validated(model: type[_B], body: Any) -> _B:
    if not isinstance(body, dict):
        raise bad("the request body must be a JSON object")
    try:
        return model.model_validate(body)
    except ValidationError as e:
        err = e.errors(include_url=False)[0]
        field = str(err["loc"][0]) if err["loc"] else None
        where = ".".join(str(x) for x in err["loc"])
        if err["type"] == "extra_forbidden":  # named in full: 'messages.0.user.tool_call_id'
            raise bad(f"'{where}' is not supported", field) from e
        if err["type"] == "too_short" and len(err["loc"]) == 1:
            raise bad(f"'{field}' must be a non-empty list", field) from e
        if field in _SHAPES and err["type"] != "missing":
            raise bad(_SHAPES[field], field) from e
        raise bad(f"'{where}': {err['msg']}", field) from e


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
    messages: list[dict[str, Any]] = field(default_factory=list)
    tool_choice: ToolChoice | None = None
    cache_salt: str | None = None
    structured_field: str | None = None  # the field that constrained the output, for its errors


def _common(req: _Sampling, served: str) -> tuple[dict[str, Any], StreamOptions, str | None]:
    if req.model is not None and req.model != served:
        raise ApiError(404, f"The model `{req.model}` does not exist.", "NotFoundError", "model")
    if req.cache_salt == "":
        raise bad("'cache_salt' must be a non-empty string", "cache_salt")
    if req.stream_options is not None and not req.stream:
        raise bad("'stream_options' is only allowed with 'stream': true", "stream_options")
    opts = req.stream_options or _StreamOptions()
    kw = req.sampling_kwargs()
    kw["structured_outputs"], structured_field = req.structured()
    # A stream takes what is new at each step (its cost does not grow with its length); a
    # plain response takes the final output only.
    kw["output_kind"] = RequestOutputKind.DELTA if req.stream else RequestOutputKind.FINAL_ONLY
    return kw, StreamOptions(opts.include_usage, opts.continuous_usage_stats), structured_field


def _params(kw: dict[str, Any]) -> SamplingParams:
    try:
        return SamplingParams(**kw)
    except InvalidArgumentError as e:
        raise bad(str(e)) from e


def parse_completion(body: Any, served: str) -> ParsedRequest:
    req = _validated(CompletionBody, body)
    kw, so, structured_field = _common(req, served)
    if req.max_tokens is None:
        kw["max_tokens"] = 16  # the completions API's default
    prompt = req.prompt
    prompts: list[str | list[int]]
    if isinstance(prompt, str):
        prompts = [prompt]
    elif prompt and all(isinstance(p, str) for p in prompt):
        prompts = [p for p in prompt if isinstance(p, str)]
    elif prompt and all(isinstance(t, int) for t in prompt):
        prompts = [[t for t in prompt if isinstance(t, int)]]
    else:
        prompts = [p for p in prompt if isinstance(p, list)]
    if not prompts or any(not p for p in prompts):
        raise bad("the prompt is empty", "prompt")
    if req.logprobs is not None:
        if not 0 <= req.logprobs <= MAX_LOGPROBS:
            raise bad(f"'logprobs' must be in [0, {MAX_LOGPROBS}]", "logprobs")
        kw["logprobs"] = req.logprobs
    return ParsedRequest(
        served,
        prompts,
        _params(kw),
        req.stream,
        so,
        echo=req.echo,
        logprobs=req.logprobs,
        cache_salt=req.cache_salt,
        structured_field=structured_field,
    )


def parse_chat(body: Any, served: str) -> ParsedRequest:
    req = _validated(ChatBody, body)
    kw, so, structured_field = _common(req, served)
    if req.max_completion_tokens is not None:
        kw["max_tokens"] = req.max_completion_tokens
    logprobs = None
    if req.logprobs:
        logprobs = req.top_logprobs or 0
        if not 0 <= logprobs <= MAX_LOGPROBS:
            raise bad(f"'top_logprobs' must be in [0, {MAX_LOGPROBS}]", "top_logprobs")
        kw["logprobs"] = logprobs
    elif req.top_logprobs is not None:
        raise bad("'top_logprobs' needs 'logprobs': true", "top_logprobs")
    messages = [m.for_template() for m in req.messages]
    tool_choice = req.tool_choice_of()
    if tool_choice is not None and (forced := tool_choice.grammar()) is not None:
        if kw["structured_outputs"] is not None:
            raise bad(f"'tool_choice' {tool_choice.kind} already constrains the output", structured_field)
        kw["structured_outputs"], structured_field = forced, "tools"
    return ParsedRequest(
        served,
        [],
        _params(kw),
        req.stream,
        so,
        logprobs=logprobs,
        messages=messages,
        tool_choice=tool_choice,
        cache_salt=req.cache_salt,
        structured_field=structured_field,
    )


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int) -> dict[str, Any]:
    """OpenAI's usage; ``cached_tokens``: prompt tokens found in the prefix cache."""
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
        "prompt_tokens_details": {"cached_tokens": cached_tokens},
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
