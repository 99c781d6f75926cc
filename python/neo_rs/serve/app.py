"""The aiohttp application: OpenAI routes, health/metrics/version, and middleware for request
ids, the access log, API keys and OpenAI-style error bodies. The server never dies on a bad
request: every failure becomes an error body with the right status."""

from __future__ import annotations

import asyncio
import hmac
import json
import logging
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

from aiohttp import web

from neo_rs import __version__
from neo_rs.engine.async_engine import AsyncEngine, QueueFull
from neo_rs.engine.sequence import CompletionOutput, RequestOutput
from neo_rs.errors import EngineStepError, InvalidArgumentError
from neo_rs.sample.sampling import SamplingParams
from neo_rs.serve.metrics import Metrics
from neo_rs.serve.openapi import openapi_document
from neo_rs.serve.protocol import (
    ApiError,
    Envelope,
    ParsedRequest,
    bad,
    chat_logprobs,
    completion_logprobs,
    new_id,
    num_output_tokens,
    parse_chat,
    parse_completion,
    usage,
)
from neo_rs.serve.tools import PARSERS, ToolStream

log = logging.getLogger(__name__)
access_log = logging.getLogger("neo_rs.access")

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]
MAX_BODY_BYTES = 4 << 20


@dataclass
class ServerState:
    served_model_name: str
    api_key: str | None = None
    tool_parser: str | None = None  # --tool-call-parser: how ``auto`` finds the model's calls
    draining: bool = False
    started: float = field(default_factory=time.time)
    request_timeout: float = 30.0  # --request-timeout: to send a body, and to read each stream part
    max_connections: int = 1024  # --max-connections
    # How many connections are open (the CLI hands over its aiohttp server's count).
    open_connections: Callable[[], int] = lambda: 0


ENGINE = web.AppKey("engine", AsyncEngine)
STATE = web.AppKey("state", ServerState)
METRICS = web.AppKey("metrics", Metrics)
OPENAPI = web.AppKey("openapi", dict)


def _error_response(err: ApiError, request_id: str | None = None) -> web.Response:
    resp = web.json_response(err.body(), status=err.status)
    if request_id:
        resp.headers["X-Request-Id"] = request_id
    return resp


@web.middleware
async def errors_and_access_log(request: web.Request, handler: Handler) -> web.StreamResponse:
    request_id = request.headers.get("X-Request-Id") or uuid.uuid4().hex
    request["request_id"] = request_id
    start = time.perf_counter()
    status = 500
    try:
        resp = await handler(request)
        status = resp.status
        if not resp.prepared:
            resp.headers["X-Request-Id"] = request_id
        return resp
    except ApiError as e:
        status = e.status
        resp = _error_response(e, request_id)
        if e.status == 408:  # the rest of the body is not waited for: the connection goes
            resp.force_close()
        return resp
    except web.HTTPException as e:  # unknown route, wrong method, body too large …
        status = e.status
        kind = "NotFoundError" if e.status == 404 else "invalid_request_error"
        resp = _error_response(ApiError(e.status, e.reason or "error", kind), request_id)
        if "Allow" in e.headers:  # a 405 says which methods the route takes (RFC 9110)
            resp.headers["Allow"] = e.headers["Allow"]
        return resp
    except asyncio.CancelledError:
        status = 499  # the client went away
        raise
    except Exception:
        log.exception("request %s failed", request_id)
        return _error_response(ApiError(500, "internal server error", "InternalServerError"), request_id)
    finally:
        ms = (time.perf_counter() - start) * 1e3
        access_log.info(
            "request_id=%s method=%s path=%s status=%d ms=%.1f",
            request_id,
            request.method,
            request.path,
            status,
            ms,
        )


@web.middleware
async def connection_limit(request: web.Request, handler: Handler) -> web.StreamResponse:
    state = request.app[STATE]
    if request.path.startswith("/v1/") and state.open_connections() > state.max_connections:
        raise ApiError(
            503,
            f"more than {state.max_connections} connections are open (--max-connections): try again later",
            "ServiceUnavailableError",
        )
    return await handler(request)


@web.middleware
async def api_key(request: web.Request, handler: Handler) -> web.StreamResponse:
    key = request.app[STATE].api_key
    if key and request.path.startswith("/v1/"):
        given = request.headers.get("Authorization", "").encode()
        if not hmac.compare_digest(given, f"Bearer {key}".encode()):  # no timing side channel
            raise ApiError(401, "invalid or missing API key", "AuthenticationError")
    return await handler(request)


def _ready(request: web.Request) -> AsyncEngine:
    engine, state = request.app[ENGINE], request.app[STATE]
    if state.draining:
        raise ApiError(503, "the server is shutting down", "ServiceUnavailableError")
    if not engine.ready.is_set() or engine.engine is None:
        raise ApiError(503, "the model is still loading", "ServiceUnavailableError")
    if engine.fatal_error is not None:
        raise ApiError(503, "the engine failed and the server is restarting", "ServiceUnavailableError")
    return engine


def _engine_failed(e: EngineStepError) -> ApiError:
    return ApiError(500, f"the engine failed on this request: {e}", "InternalServerError")


async def health(request: web.Request) -> web.Response:
    engine, state = request.app[ENGINE], request.app[STATE]
    ok = engine.ready.is_set() and engine.engine is not None and not state.draining
    ok = ok and engine.fatal_error is None
    return web.json_response({"status": "ok" if ok else "unavailable"}, status=200 if ok else 503)


async def openapi(request: web.Request) -> web.Response:
    return web.json_response(request.app[OPENAPI])


async def version(request: web.Request) -> web.Response:
    return web.json_response({"version": __version__})


async def models(request: web.Request) -> web.Response:
    state, engine = request.app[STATE], request.app[ENGINE]
    card: dict[str, Any] = {
        "id": state.served_model_name,
        "object": "model",
        "created": int(state.started),
        "owned_by": "neo_rs",
    }
    if engine.engine is not None:
        card["max_model_len"] = engine.engine.max_model_len
    return web.json_response({"object": "list", "data": [card]})


async def metrics(request: web.Request) -> web.Response:
    body = request.app[METRICS].render()
    return web.Response(body=body, headers={"Content-Type": "text/plain; version=0.0.4; charset=utf-8"})


async def _json_body(request: web.Request) -> Any:
    timeout = request.app[STATE].request_timeout
    try:
        raw = await asyncio.wait_for(request.read(), timeout)  # 413 past the app's client_max_size
    except asyncio.TimeoutError as e:
        raise ApiError(
            408, f"the request body did not arrive within {timeout:g} s (--request-timeout)", "timeout"
        ) from e
    try:
        return json.loads(raw)
    except (ValueError, UnicodeDecodeError) as e:
        raise bad(f"invalid JSON body: {e}") from e
    except RecursionError as e:  # nested past the interpreter's recursion limit
        raise bad("invalid JSON body: nested too deeply") from e


async def _prompt_ids(
    engine: AsyncEngine, prompt: str | list[int], params: SamplingParams, special: bool
) -> list[int]:
    try:
        ids = await engine.tokenize(prompt, add_special_tokens=special) if isinstance(prompt, str) else prompt
        engine.check(ids, params)
    except InvalidArgumentError as e:
        raise bad(str(e), "prompt") from e
    return ids


async def _compile_grammar(engine: AsyncEngine, parsed: ParsedRequest) -> None:
    try:
        await engine.compile_grammar(parsed.params)
    except InvalidArgumentError as e:
        raise bad(f"'{parsed.structured_field}': {e}", parsed.structured_field) from e


async def _merged(gens: list[AsyncIterator[RequestOutput]]) -> AsyncIterator[tuple[int, RequestOutput]]:
    """Outputs of several requests as they come, tagged with the request's index."""
    if len(gens) == 1:
        async for out in gens[0]:
            yield 0, out
        return
    q: asyncio.Queue[tuple[int, RequestOutput | BaseException | None]] = asyncio.Queue()

    async def pump(i: int, g: AsyncIterator[RequestOutput]) -> None:
        try:
            async for out in g:
                await q.put((i, out))
        except BaseException as e:  # noqa: BLE001 (re-raised by the consumer)
            await q.put((i, e))
        await q.put((i, None))

    tasks = [asyncio.create_task(pump(i, g)) for i, g in enumerate(gens)]
    try:
        live = len(gens)
        while live:
            i, item = await q.get()
            if item is None:
                live -= 1
            elif isinstance(item, BaseException):
                raise item
            else:
                yield i, item
    finally:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


class _Stalled(Exception):
    """A streaming client stopped reading (``--request-timeout``)."""


class _Run:
    """One OpenAI request in flight: its engine requests, envelope and stream state."""

    def __init__(self, request: web.Request, parsed: ParsedRequest, chat: bool) -> None:
        self.request, self.parsed, self.chat = request, parsed, chat
        self.engine = request.app[ENGINE]
        self.env = Envelope(new_id("chatcmpl" if chat else "cmpl"), parsed.model)
        self.prompts: list[tuple[str | None, list[int]]] = []
        self.tool_parser = request.app[STATE].tool_parser
        self.tool_streams: dict[int, ToolStream] = {}
        self.cached: dict[int, int] = {}  # prompt index -> its prompt tokens found in the prefix cache

    def start(self) -> list[AsyncIterator[RequestOutput]]:
        base = self.request["request_id"]
        try:
            self.engine.reserve(len(self.prompts))
        except QueueFull as e:
            raise ApiError(429, str(e), "RateLimitError") from e
        return [
            self.engine.generate(
                f"{base}-{i}",
                text if text is not None else ids,
                ids,
                self.parsed.params,
                self.parsed.cache_salt,
            )
            for i, (text, ids) in enumerate(self.prompts)
        ]

    def choice_index(self, prompt_index: int, seq_index: int) -> int:
        return prompt_index * self.parsed.params.n + seq_index

    def prompt_tokens(self) -> int:
        return sum(len(ids) for _, ids in self.prompts)

    def usage(self, completion_tokens: int) -> dict[str, Any]:
        return usage(self.prompt_tokens(), completion_tokens, sum(self.cached.values()))

    def echo_text(self, prompt_index: int) -> str:
        text, ids = self.prompts[prompt_index]
        if text is not None:
            return text
        return "".join(self.engine.token_text(t) for t in ids)

    def logprobs(self, out: CompletionOutput, t0: int, t1: int, offset: int) -> dict[str, Any] | None:
        if self.parsed.logprobs is None:
            return None
        if self.chat:
            return chat_logprobs(out, t0, t1, self.engine.token_text, self.parsed.logprobs)
        return completion_logprobs(out, t0, t1, self.engine.token_text, offset)

    def reply(self, idx: int, out: CompletionOutput) -> tuple[dict[str, Any], dict[str, Any]]:
        """A choice's new text as response fields (``text``; ``content`` and any ``tool_calls``
        found so far), and its finish fields."""
        if not self.chat:
            return {"text": out.text}, _finish(out)
        if self.parsed.tool_choice is None:
            return {"content": out.text}, _finish(out)
        stream = self.tool_streams.setdefault(idx, ToolStream(self.parsed.tool_choice, self.tool_parser))
        content, calls = stream.feed(out.text, final=out.finish_reason is not None)
        fields: dict[str, Any] = {"content": content} if content or not calls else {}
        if calls:
            fields["tool_calls"] = calls
        return fields, {**_finish(out), "finish_reason": stream.finish_reason(out.finish_reason)}


def _finish(out: CompletionOutput) -> dict[str, Any]:
    return {"finish_reason": out.finish_reason, "stop_reason": out.stop_reason}


def _message(fields: dict[str, Any]) -> dict[str, Any]:
    """A whole chat reply: ``content`` is null beside tool calls with no text, as OpenAI's."""
    calls = [{k: v for k, v in c.items() if k != "index"} for c in fields.get("tool_calls", [])]
    content = (fields.get("content") or None) if calls else fields.get("content", "")
    return {"role": "assistant", "content": content, **({"tool_calls": calls} if calls else {})}


async def _respond(run: _Run) -> web.StreamResponse:
    gens = run.start()
    if run.parsed.stream:
        return await _stream(run, gens)
    finals: dict[int, RequestOutput] = {}
    try:
        async for i, out in _merged(gens):
            run.cached[i] = out.num_cached_tokens
            if out.finished:
                finals[i] = out
    except EngineStepError as e:
        raise _engine_failed(e) from e
    except InvalidArgumentError as e:  # refused as the engine added it
        raise bad(str(e)) from e
    choices = []
    for i in sorted(finals):
        for o in finals[i].outputs:
            idx = run.choice_index(i, o.index)
            lp = run.logprobs(o, 0, len(o.token_ids), 0)
            if run.chat:
                fields, fin = run.reply(idx, o)
                choices.append({"index": idx, "message": _message(fields), "logprobs": lp, **fin})
            else:
                text = (run.echo_text(i) + o.text) if run.parsed.echo else o.text
                choices.append({"index": idx, "text": text, "logprobs": lp, **_finish(o)})
    completion = sum(num_output_tokens(f) for f in finals.values())
    obj = "chat.completion" if run.chat else "text_completion"
    return web.json_response(run.env.wrap(obj, choices, usage=run.usage(completion)))


async def _stream(run: _Run, gens: list[AsyncIterator[RequestOutput]]) -> web.StreamResponse:
    resp = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
    resp.headers["X-Request-Id"] = run.request["request_id"]
    await resp.prepare(run.request)
    timeout = run.request.app[STATE].request_timeout

    async def send(payload: dict[str, Any]) -> None:
        # A client that stops reading fills the socket, then aiohttp's buffer (64 KiB), and the
        # write waits: past the timeout the stream is dropped and its requests aborted, so that
        # neither it nor the engine's queue for it grows.
        try:
            await asyncio.wait_for(resp.write(b"data: " + json.dumps(payload).encode() + b"\n\n"), timeout)
        except asyncio.TimeoutError as e:
            raise _Stalled(f"the client read nothing for {timeout:g} s (--request-timeout)") from e

    try:
        await _stream_events(run, gens, send)
    except _Stalled as e:
        log.warning("request %s: %s; its stream is dropped", run.request["request_id"], e)
        if run.request.transport is not None:
            run.request.transport.close()
        return resp
    await resp.write(b"data: [DONE]\n\n")
    await resp.write_eof()
    return resp


async def _stream_events(
    run: _Run,
    gens: list[AsyncIterator[RequestOutput]],
    send: Callable[[dict[str, Any]], Awaitable[None]],
) -> None:
    """The stream's events up to (not including) ``[DONE]``."""
    obj = "chat.completion.chunk" if run.chat else "text_completion"
    opts = run.parsed.stream_options
    # The engine hands out deltas (text it holds back while it may still start a stop string).
    sent_chars: dict[int, int] = {}
    finished: set[int] = set()
    produced = 0

    def extra() -> dict[str, Any]:
        return {"usage": run.usage(produced)} if opts.continuous_usage_stats else {}

    if run.chat:
        first = [
            {
                "index": run.choice_index(i, s),
                "delta": {"role": "assistant", "content": ""},
                "logprobs": None,
                "finish_reason": None,
            }
            for i in range(len(gens))
            for s in range(run.parsed.params.n)
        ]
        await send(run.env.wrap(obj, first, **extra()))
    elif run.parsed.echo:
        echo = [
            {
                "index": run.choice_index(i, s),
                "text": run.echo_text(i),
                "logprobs": None,
                "finish_reason": None,
            }
            for i in range(len(gens))
            for s in range(run.parsed.params.n)
        ]
        await send(run.env.wrap(obj, echo, **extra()))
    try:
        async for i, out in _merged(gens):
            run.cached[i] = out.num_cached_tokens
            for o in out.outputs:
                idx = run.choice_index(i, o.index)
                if idx in finished or not (o.token_ids or o.text or o.finish_reason):
                    continue  # finished earlier, or another sequence of this request moved
                offset = sent_chars.get(idx, 0)
                sent_chars[idx] = offset + len(o.text)
                produced += len(o.token_ids)
                fields, fin = run.reply(idx, o)
                fin = fin if o.finish_reason else {"finish_reason": None}
                lp = run.logprobs(o, 0, len(o.token_ids), offset)
                if not any(fields.values()) and lp is None and not o.finish_reason:
                    continue  # a token that completes no character (or no call) yet
                body = {"delta": fields} if run.chat else fields
                await send(run.env.wrap(obj, [{"index": idx, **body, "logprobs": lp, **fin}], **extra()))
                if o.finish_reason:
                    finished.add(idx)
    except EngineStepError as e:  # the stream has begun: the error goes in an event, then [DONE]
        await send(_engine_failed(e).body())
    except InvalidArgumentError as e:
        await send(bad(str(e)).body())
    else:
        if opts.include_usage:
            await send(run.env.wrap(obj, [], usage=run.usage(produced)))


async def completions(request: web.Request) -> web.StreamResponse:
    engine = _ready(request)
    parsed = parse_completion(await _json_body(request), request.app[STATE].served_model_name)
    await _compile_grammar(engine, parsed)
    run = _Run(request, parsed, chat=False)
    for p in parsed.prompts:
        ids = await _prompt_ids(engine, p, parsed.params, special=True)
        run.prompts.append((p if isinstance(p, str) else None, ids))
    return await _respond(run)


async def chat_completions(request: web.Request) -> web.StreamResponse:
    engine = _ready(request)
    state = request.app[STATE]
    parsed = parse_chat(await _json_body(request), state.served_model_name)
    tools = parsed.tool_choice
    if tools is not None and tools.kind == "auto" and state.tool_parser is None:
        raise bad(
            "'tool_choice' auto (the default with 'tools') needs a server started with --tool-call-parser "
            f"({' or '.join(PARSERS)}); 'required' or a named function work without one",
            "tool_choice",
        )
    try:
        text = await engine.apply_chat_template(parsed.messages, tools.tools if tools else None)
    except InvalidArgumentError as e:
        raise bad(str(e), "messages") from e
    except Exception as e:  # a template that rejects these messages
        raise bad(f"the chat template failed: {e}", "messages") from e
    await _compile_grammar(engine, parsed)
    run = _Run(request, parsed, chat=True)
    run.prompts.append((text, await _prompt_ids(engine, text, parsed.params, special=False)))
    return await _respond(run)


def create_app(engine: AsyncEngine, state: ServerState, metrics_: Metrics) -> web.Application:
    app = web.Application(
        middlewares=[errors_and_access_log, connection_limit, api_key], client_max_size=MAX_BODY_BYTES
    )
    app[ENGINE], app[STATE], app[METRICS] = engine, state, metrics_
    app[OPENAPI] = openapi_document()
    app.router.add_get("/health", health)
    app.router.add_get("/version", version)
    app.router.add_get("/openapi.json", openapi)
    app.router.add_get("/metrics", metrics)
    app.router.add_get("/v1/models", models)
    app.router.add_post("/v1/completions", completions)
    app.router.add_post("/v1/chat/completions", chat_completions)
    return app
