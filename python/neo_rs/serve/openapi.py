"""``GET /openapi.json``: the server's OpenAPI 3.1 document, generated from the pydantic models
of its requests (``protocol.py``, the ones that validate every body) and of its responses (here;
``tests/python/test_openapi.py`` holds real responses to them). Clients, gateways and the fuzzer
(Schemathesis, ``benches/fuzz_server.sh``) read it."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel
from pydantic.json_schema import models_json_schema

from neo_rs import __version__
from neo_rs.serve.protocol import ChatBody, CompletionBody

# -- responses --------------------------------------------------------------------------------


class ErrorDetail(BaseModel):
    message: str
    type: str
    param: str | None
    code: int


class ErrorResponse(BaseModel):
    error: ErrorDetail


class PromptTokensDetails(BaseModel):
    cached_tokens: int


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails


class CompletionLogprobs(BaseModel):
    tokens: list[str]
    token_logprobs: list[float]
    top_logprobs: list[dict[str, float]]
    text_offset: list[int]


class CompletionChoice(BaseModel):
    index: int
    text: str
    logprobs: CompletionLogprobs | None
    finish_reason: Literal["stop", "length", "abort"] | None
    stop_reason: int | str | None


class Completion(BaseModel):
    id: str
    object: Literal["text_completion"]
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage


class TopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int]


class TokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob]


class ChatLogprobs(BaseModel):
    content: list[TokenLogprob]


class FunctionCall(BaseModel):
    name: str
    arguments: str


class ToolCall(BaseModel):
    id: str
    type: Literal["function"]
    function: FunctionCall


class AssistantMessage(BaseModel):
    role: Literal["assistant"]
    content: str | None
    tool_calls: list[ToolCall] | None = None


class ChatChoice(BaseModel):
    index: int
    message: AssistantMessage
    logprobs: ChatLogprobs | None
    finish_reason: Literal["stop", "length", "abort", "tool_calls"] | None
    stop_reason: int | str | None


class ChatCompletion(BaseModel):
    id: str
    object: Literal["chat.completion"]
    created: int
    model: str
    choices: list[ChatChoice]
    usage: Usage


class ModelCard(BaseModel):
    id: str
    object: Literal["model"]
    created: int
    owned_by: str
    max_model_len: int | None = None


class ModelList(BaseModel):
    object: Literal["list"]
    data: list[ModelCard]


class Health(BaseModel):
    status: Literal["ok", "unavailable"]


class Version(BaseModel):
    version: str


# -- the document -----------------------------------------------------------------------------

_MODELS: list[type[BaseModel]] = [
    CompletionBody,
    ChatBody,
    Completion,
    ChatCompletion,
    ModelList,
    Health,
    Version,
    ErrorResponse,
]
# Every status a /v1 call may answer besides 200, as the server sends them (docs/serving.md).
_ERRORS = {
    "400": "invalid request: JSON, types, values, or a limit",
    "401": "missing or wrong API key (--api-key)",
    "404": "unknown model",
    "408": "the body did not arrive within --request-timeout",
    "413": "body over 4 MiB",
    "429": "the waiting queue is full (--max-waiting)",
    "500": "the engine failed on this request",
    "503": "loading, draining, or past --max-connections",
}
# Under OpenAPI 3.1 a stream's schema describes each server-sent event.
_SSE = {
    "text/event-stream": {
        "schema": {
            "type": "object",
            "required": ["data"],
            "properties": {
                "data": {
                    "type": "string",
                    "description": "a JSON chunk (the response's shape, choices holding deltas), "
                    "an error body, or [DONE]",
                },
                "event": {"type": "string"},
            },
        }
    }
}


def _ref(model: type[BaseModel]) -> dict[str, str]:
    return {"$ref": f"#/components/schemas/{model.__name__}"}


def _json(model: type[BaseModel]) -> dict[str, Any]:
    return {"application/json": {"schema": _ref(model)}}


def _generate(request: type[BaseModel], response: type[BaseModel], summary: str) -> dict[str, Any]:
    errors = {code: {"description": why, "content": _json(ErrorResponse)} for code, why in _ERRORS.items()}
    return {
        "post": {
            "summary": summary,
            "requestBody": {"required": True, "content": _json(request)},
            "responses": {
                "200": {
                    "description": "the whole response, or with `stream: true` server-sent events",
                    "content": {**_json(response), **_SSE},
                },
                **errors,
            },
        }
    }


def _get(model: type[BaseModel], summary: str, *extra: str) -> dict[str, Any]:
    responses: dict[str, Any] = {"200": {"description": summary, "content": _json(model)}}
    for code in extra:
        responses[code] = {"description": _ERRORS.get(code, summary), "content": _json(model)}
    return {"get": {"summary": summary, "responses": responses}}


def openapi_document() -> dict[str, Any]:
    _, defs = models_json_schema(
        [(m, "validation" if m in (CompletionBody, ChatBody) else "serialization") for m in _MODELS],
        ref_template="#/components/schemas/{model}",
    )
    return {
        "openapi": "3.1.0",
        "info": {"title": "neo_rs", "version": __version__, "description": "OpenAI-compatible API"},
        "paths": {
            "/v1/completions": _generate(CompletionBody, Completion, "text completions"),
            "/v1/chat/completions": _generate(ChatBody, ChatCompletion, "chat completions"),
            "/v1/models": _get(ModelList, "the served model"),
            "/health": _get(Health, "ready to serve", "503"),
            "/version": _get(Version, "the server's version"),
            "/metrics": {
                "get": {
                    "summary": "Prometheus metrics",
                    "responses": {
                        "200": {
                            "description": "metrics",
                            "content": {"text/plain": {"schema": {"type": "string"}}},
                        }
                    },
                }
            },
        },
        "components": {"schemas": defs["$defs"]},
    }
