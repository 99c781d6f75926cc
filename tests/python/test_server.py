"""The OpenAI-compatible server, through the real ``openai`` client and raw aiohttp: endpoints,
streaming, sampling options, the error matrix, API keys, backpressure, disconnects, load and
graceful shutdown. Every server runs the built-in demo model in a subprocess; the shared one runs
once on one rank and once with ``--tensor-parallel-size 2``."""

from __future__ import annotations

import asyncio
import json
import signal
import subprocess
import sys
import time
from collections.abc import Iterator

import aiohttp
import openai
import pytest
from neo_rs import __version__
from server_util import Server

MODEL = "neo-rs-demo"


@pytest.fixture(scope="module", params=[1, 2], ids=["tp1", "tp2"])
def server(request: pytest.FixtureRequest) -> Iterator[Server]:
    s = Server("--max-num-seqs", "128", "--tensor-parallel-size", str(request.param))
    yield s
    assert s.stop() == 0


@pytest.fixture(scope="module")
def client(server: Server) -> openai.OpenAI:
    return server.client()


def test_models_health_version_metrics(server: Server, client: openai.OpenAI) -> None:
    assert [m.id for m in client.models.list().data] == [MODEL]
    import urllib.request

    with urllib.request.urlopen(server.url + "/version") as r:
        assert json.loads(r.read()) == {"version": __version__}
    client.completions.create(model=MODEL, prompt="metrics", max_tokens=3)
    assert server.metric("neo:request_success_total", finished_reason="length") >= 1
    assert server.metric("neo:generation_tokens_total") >= 3
    assert server.metric("neo:time_to_first_token_seconds_count") >= 1
    assert server.metric("neo:kv_cache_usage_perc", pool="gpu") == 0


def test_prefix_cache_metrics(server: Server, client: openai.OpenAI) -> None:
    prompt = "A long shared system prompt that fills more than one block of tokens. " * 4
    before = server.metric("neo:prefix_cache_hits_total", tier="device")
    cached = []
    for stream in (False, True):
        kw = {"stream_options": {"include_usage": True}} if stream else {}
        resp = client.completions.create(model=MODEL, prompt=prompt, max_tokens=2, stream=stream, **kw)
        usage = [c for c in resp][-1].usage if stream else resp.usage
        cached.append(usage.prompt_tokens_details.cached_tokens)
    # The second request found at least the first block of the first one's prompt.
    assert cached[0] == 0 and cached[1] >= 16 and cached[1] % 16 == 0, cached
    assert server.metric("neo:prefix_cache_hits_total", tier="device") >= before + cached[1]
    assert server.metric("neo:prefix_cache_queries_total") >= 2 * 16
    assert server.metric("neo:prefix_cache_blocks", tier="device") >= 1


def test_cache_salt_keeps_prefix_caches_apart(server: Server, client: openai.OpenAI) -> None:
    prompt = "Another long system prompt, this one shared only within a tenant's salt. " * 4

    def hits_of(salt: str) -> float:
        before = server.metric("neo:prefix_cache_hits_total", tier="device")
        client.completions.create(model=MODEL, prompt=prompt, max_tokens=2, extra_body={"cache_salt": salt})
        return server.metric("neo:prefix_cache_hits_total", tier="device") - before

    assert hits_of("tenant a") == 0
    assert hits_of("tenant a") >= 16
    assert hits_of("tenant b") == 0


def test_completion_stream_matches_non_stream(client: openai.OpenAI) -> None:
    kw = dict(model=MODEL, prompt="The quick brown fox", max_tokens=24, temperature=0)
    full = client.completions.create(**kw)
    assert full.choices[0].finish_reason == "length"
    assert full.usage is not None and full.usage.completion_tokens == 24
    chunks = list(client.completions.create(stream=True, stream_options={"include_usage": True}, **kw))
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    assert text == full.choices[0].text
    assert chunks[-1].usage is not None and chunks[-1].usage.total_tokens == full.usage.total_tokens
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"


def test_chat_stream_and_non_stream(client: openai.OpenAI) -> None:
    msgs = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hello!"}]
    full = client.chat.completions.create(model=MODEL, messages=msgs, max_tokens=16, temperature=0)
    assert full.choices[0].message.role == "assistant"
    chunks = list(
        client.chat.completions.create(model=MODEL, messages=msgs, max_tokens=16, temperature=0, stream=True)
    )
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == full.choices[0].message.content
    assert full.usage is not None and full.usage.prompt_tokens > 10


def test_n_seed_logprobs_and_token_prompts(client: openai.OpenAI) -> None:
    kw = dict(model=MODEL, prompt=[72, 105, 33], max_tokens=8, temperature=1.0, seed=123, n=3, logprobs=2)
    a = client.completions.create(**kw)
    b = client.completions.create(**kw)
    assert [c.index for c in a.choices] == [0, 1, 2]
    assert [c.text for c in a.choices] == [c.text for c in b.choices]
    lp = a.choices[0].logprobs
    assert lp is not None and len(lp.token_logprobs) == 8 and all(len(t) >= 1 for t in lp.top_logprobs)
    chat = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "x"}], max_tokens=4, logprobs=True, top_logprobs=2
    )
    content = chat.choices[0].logprobs.content
    assert len(content) == 4 and all(len(c.top_logprobs) == 2 for c in content)
    two = client.completions.create(model=MODEL, prompt=["a", "b"], max_tokens=2, n=2)
    assert sorted(c.index for c in two.choices) == [0, 1, 2, 3]


def test_logit_bias(client: openai.OpenAI) -> None:
    # The demo tokenizer is byte-level: token 65 is "A".
    kw = dict(model=MODEL, prompt="Hello", max_tokens=6, temperature=0)

    def text(bias: dict[str, int]) -> str:
        return client.completions.create(**kw, logit_bias=bias).choices[0].text

    assert text({"65": 100}) == "A" * 6
    assert text({"65": 50, "66": 40}) == "A" * 6
    assert text({"65": -50, "66": 40}) == "B" * 6  # only the sign of A's bias changed


def test_echo(client: openai.OpenAI) -> None:
    full = client.completions.create(model=MODEL, prompt="Echo me", max_tokens=4, temperature=0, echo=True)
    plain = client.completions.create(model=MODEL, prompt="Echo me", max_tokens=4, temperature=0)
    assert full.choices[0].text == "Echo me" + plain.choices[0].text
    chunks = client.completions.create(
        model=MODEL, prompt="Echo me", max_tokens=4, temperature=0, echo=True, stream=True
    )
    assert "".join(c.choices[0].text for c in chunks) == full.choices[0].text


def test_stop_strings(client: openai.OpenAI) -> None:
    # The demo model's text is random bytes; take a prompt whose greedy text is long enough.
    for prompt in ("Once upon a time", "The quick brown fox", "Stop here please", "abc"):
        free = client.completions.create(model=MODEL, prompt=prompt, max_tokens=32, temperature=0).choices[0]
        if len(free.text) >= 8:
            break
    stop = free.text[4:6]
    cut = free.text.index(stop)
    got = client.completions.create(model=MODEL, prompt=prompt, max_tokens=32, temperature=0, stop=[stop])
    assert got.choices[0].text == free.text[:cut] and got.choices[0].finish_reason == "stop"
    assert got.choices[0].model_extra["stop_reason"] == stop
    streamed = client.completions.create(
        model=MODEL, prompt=prompt, max_tokens=32, temperature=0, stop=stop, stream=True
    )
    assert "".join(c.choices[0].text for c in streamed) == free.text[:cut]


async def _sse(
    url: str, body: dict, headers: dict | None = None
) -> tuple[aiohttp.ClientResponse, list[bytes]]:
    async with aiohttp.ClientSession() as s, s.post(url, json=body, headers=headers or {}) as r:
        return r, [line async for line in r.content]


def test_raw_sse_framing_and_request_id(server: Server) -> None:
    body = {
        "model": MODEL,
        "prompt": "frame",
        "max_tokens": 5,
        "stream": True,
        "stream_options": {"include_usage": True, "continuous_usage_stats": True},
    }
    r, lines = asyncio.run(_sse(server.url + "/v1/completions", body, {"X-Request-Id": "abc-123"}))
    assert r.status == 200 and r.headers["Content-Type"].startswith("text/event-stream")
    assert r.headers["X-Request-Id"] == "abc-123"
    events = b"".join(lines).split(b"\n\n")
    assert events[-1] == b"" and events[-2] == b"data: [DONE]"
    payloads = [json.loads(e.removeprefix(b"data: ")) for e in events[:-2]]
    assert all(e.startswith(b"data: ") for e in events[:-1])
    assert all(p["usage"] is not None for p in payloads)
    assert payloads[-1]["choices"] == [] and payloads[-1]["usage"]["completion_tokens"] == 5


BIG = "x" * (5 << 20)


def _bad_cases() -> list[tuple[str, str, object, int]]:
    c, ch = "/v1/completions", "/v1/chat/completions"
    ok_msgs = [{"role": "user", "content": "hi"}]
    cases = [
        ("POST", c, b"{not json", 400),
        ("POST", c, b"[1, 2]", 400),
        ("POST", c, {"prompt": ""}, 400),
        ("POST", c, {"prompt": []}, 400),
        ("POST", c, {"prompt": 5}, 400),
        ("POST", c, {"prompt": [[1, "a"]]}, 400),
        ("POST", c, {"prompt": [1, 999999]}, 400),
        ("POST", c, {"prompt": "a", "max_tokens": 0}, 400),
        ("POST", c, {"prompt": "a", "max_tokens": "5"}, 400),
        ("POST", c, {"prompt": "a", "max_tokens": 10**9}, 400),
        ("POST", c, {"prompt": "a" * 5000}, 400),
        ("POST", c, {"prompt": "a", "temperature": -1}, 400),
        ("POST", c, {"prompt": "a", "temperature": "hot"}, 400),
        ("POST", c, {"prompt": "a", "top_p": 0}, 400),
        ("POST", c, {"prompt": "a", "top_p": 1.5}, 400),
        ("POST", c, {"prompt": "a", "top_k": -5}, 400),
        ("POST", c, {"prompt": "a", "min_p": 2}, 400),
        ("POST", c, {"prompt": "a", "n": 0}, 400),
        ("POST", c, {"prompt": "a", "n": True}, 400),
        ("POST", c, {"prompt": "a", "presence_penalty": 5}, 400),
        ("POST", c, {"prompt": "a", "frequency_penalty": -3}, 400),
        ("POST", c, {"prompt": "a", "repetition_penalty": 0}, 400),
        ("POST", c, {"prompt": "a", "seed": 1.5}, 400),
        ("POST", c, {"prompt": "a", "stop": 7}, 400),
        ("POST", c, {"prompt": "a", "stop": [""]}, 400),
        ("POST", c, {"prompt": "a", "stop_token_ids": [-1]}, 400),
        ("POST", c, {"prompt": "a", "logprobs": 50}, 400),
        ("POST", c, {"prompt": "a", "min_tokens": 9, "max_tokens": 2}, 400),
        ("POST", c, {"prompt": "a", "stream": "yes"}, 400),
        ("POST", c, {"prompt": "a", "stream_options": {"include_usage": True}}, 400),
        ("POST", c, {"prompt": "a", "model": "gpt-9"}, 404),
        ("POST", c, {"prompt": "a", "model": 3}, 400),
        ("POST", c, {"prompt": "a", "cache_salt": ""}, 400),
        ("POST", ch, {"messages": ok_msgs, "cache_salt": 7}, 400),
        ("POST", ch, {"messages": []}, 400),
        ("POST", ch, {"messages": "hi"}, 400),
        ("POST", ch, {"messages": [{"role": "wizard", "content": "x"}]}, 400),
        ("POST", ch, {"messages": [{"role": "user", "content": 3}]}, 400),
        ("POST", ch, {"messages": ok_msgs, "top_logprobs": 2}, 400),
        ("POST", ch, {"messages": ok_msgs, "logprobs": True, "top_logprobs": 99}, 400),
        ("POST", ch, {"messages": ok_msgs, "max_completion_tokens": 0}, 400),
        # Numbers Python's json accepts but JSON does not; values out of every range.
        ("POST", c, b'{"prompt": "a", "temperature": NaN}', 400),
        ("POST", c, b'{"prompt": "a", "temperature": Infinity}', 400),
        ("POST", c, b'{"prompt": "a", "top_p": -Infinity}', 400),
        ("POST", ch, b'{"messages": [{"role": "user", "content": "hi"}], "temperature": NaN}', 400),
        ("POST", c, b'{"prompt": "a", "repetition_penalty": NaN}', 400),
        ("POST", c, {"prompt": "a", "seed": 2**70}, 400),
        ("POST", c, {"prompt": "a", "seed": -(2**70)}, 400),
        ("POST", c, b'{"prompt": ' + b"[" * 5000 + b"]" * 5000 + b"}", 400),
        ("POST", c, {"prompt": [[[1]]]}, 400),
        ("POST", c, {"prompt": [[]]}, 400),
        ("POST", c, {"prompt": [True]}, 400),
        ("POST", c, {"prompt": "a", "n": 10000}, 400),
        ("POST", ch, {"messages": ok_msgs, "n": 129}, 400),
        ("POST", c, {"prompt": "a", "top_k": 1.5}, 400),
        ("POST", c, {"prompt": "a", "min_tokens": -1}, 400),
        ("POST", c, {"prompt": "a", "max_tokens": -1}, 400),
        ("POST", c, {"prompt": "a", "ignore_eos": "yes"}, 400),
        ("POST", c, {"prompt": "a", "echo": 1}, 400),
        ("POST", c, {"prompt": "a", "logprobs": True}, 400),
        ("POST", c, {"prompt": "a", "stop": [1]}, 400),
        ("POST", c, {"prompt": "a", "stop_token_ids": "x"}, 400),
        ("POST", c, {"prompt": "a", "stream": True, "stream_options": {"include_usage": 1}}, 400),
        ("POST", c, {"prompt": "a", "stream": True, "stream_options": {"everything": True}}, 400),
        # logit_bias: token ids (as strings) to biases in [-100, 100], ids inside the vocabulary.
        ("POST", c, {"prompt": "a", "logit_bias": {"abc": 1}}, 400),
        ("POST", c, {"prompt": "a", "logit_bias": {"5": 500}}, 400),
        ("POST", c, {"prompt": "a", "logit_bias": {"999999": 1}}, 400),
        ("POST", c, {"prompt": "a", "logit_bias": [5]}, 400),
        # Fields we do not implement are refused by name, never ignored.
        ("POST", c, {"prompt": "a", "best_of": 2}, 400),
        ("POST", c, {"prompt": "a", "suffix": "z"}, 400),
        ("POST", c, {"prompt": "a", "no_such_field": 1}, 400),
        # Tools: well-formed, and a tool_choice only with tools (more in test_tools.py).
        ("POST", ch, {"messages": ok_msgs, "tools": [{"type": "function"}]}, 400),
        ("POST", ch, {"messages": ok_msgs, "tool_choice": "auto"}, 400),
        ("POST", c, {"prompt": "a", "tools": []}, 400),
        # Structured outputs: one constraint per request, and one that compiles.
        ("POST", ch, {"messages": ok_msgs, "response_format": {"type": "json_schema"}}, 400),
        ("POST", ch, {"messages": ok_msgs, "response_format": {"type": "xml"}}, 400),
        (
            "POST",
            c,
            {"prompt": "a", "response_format": {"type": "json_schema", "json_schema": {"name": "x"}}},
            400,
        ),
        ("POST", c, {"prompt": "a", "guided_json": {"type": "no-such-type"}}, 400),
        ("POST", c, {"prompt": "a", "guided_json": "{not json"}, 400),
        ("POST", c, {"prompt": "a", "guided_json": [1, 2]}, 400),
        ("POST", c, {"prompt": "a", "guided_regex": "(unclosed"}, 400),
        ("POST", c, {"prompt": "a", "guided_choice": []}, 400),
        ("POST", c, {"prompt": "a", "guided_grammar": "start: undefined_rule"}, 400),
        ("POST", c, {"prompt": "a", "structured_outputs": {}}, 400),
        ("POST", c, {"prompt": "a", "structured_outputs": {"regex": "a", "choice": ["a"]}}, 400),
        ("POST", c, {"prompt": "a", "structured_outputs": {"xml": "a"}}, 400),
        (
            "POST",
            c,
            {"prompt": "a", "guided_regex": "a+", "response_format": {"type": "json_object"}},
            400,
        ),
        (
            "POST",
            c,
            {"prompt": "a", "structured_outputs": {"json": {"$ref": "#/$defs/missing"}}},
            400,
        ),
        ("POST", ch, {"messages": ok_msgs, "logprobs": 1}, 400),
        ("POST", ch, {"messages": [{"role": "tool", "content": "x"}]}, 400),
        ("POST", ch, {"messages": [{"role": "user"}]}, 400),
        ("POST", ch, {"messages": [{"role": "user", "content": "x", "name": "bob"}]}, 400),
        (
            "POST",
            ch,
            {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]},
            400,
        ),
        ("POST", ch, {"messages": ok_msgs, "max_completion_tokens": "8"}, 400),
        ("POST", c, {"prompt": BIG}, 413),
        ("GET", "/v1/nothing", None, 404),
        ("GET", c, None, 405),
    ]
    return cases


async def _send(url: str, method: str, body: object) -> tuple[int, dict]:
    data = body if isinstance(body, bytes) else (json.dumps(body).encode() if body is not None else None)
    async with aiohttp.ClientSession() as s, s.request(method, url, data=data) as r:
        return r.status, await r.json(content_type=None)


def test_bad_input_matrix(server: Server) -> None:
    cases = _bad_cases()

    async def run() -> list[tuple[int, dict]]:
        return [await _send(server.url + path, method, body) for method, path, body, _ in cases]

    for (method, path, body, want), (status, payload) in zip(cases, asyncio.run(run()), strict=True):
        shown = body if not isinstance(body, str | bytes) or len(body) < 80 else "<big>"
        assert status == want, (method, path, shown, payload)
        err = payload["error"]
        assert set(err) == {"message", "type", "param", "code"} and err["code"] == want and err["message"]
        if isinstance(body, dict) and want == 400 and len(body) == 2:  # the one bad field is named
            name = next(k for k in body if k not in ("prompt", "messages"))
            assert name in err["message"] or err["param"] == name, (name, err)
    status, _ = asyncio.run(_send(server.url + "/health", "GET", None))
    assert status == 200


def test_disconnects_free_every_block(server: Server, client: openai.OpenAI) -> None:
    async def drop(i: int) -> None:
        body = {
            "model": MODEL,
            "prompt": f"disconnect {i}",
            "max_tokens": 1500,
            "stream": True,
            "ignore_eos": True,
        }
        async with aiohttp.ClientSession() as s, s.post(server.url + "/v1/completions", json=body) as r:
            assert r.status == 200
            await r.content.readline()  # the first event, then hang up

    async def run() -> None:
        await asyncio.gather(*(drop(i) for i in range(100)))

    asyncio.run(run())
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        used = server.metric("neo:kv_blocks_used", pool="gpu") + server.metric(
            "neo:kv_blocks_used", pool="cpu"
        )
        if used == 0 and server.metric("neo:num_requests_running") == 0:
            break
        time.sleep(0.2)
    assert used == 0 and server.metric("neo:num_requests_running") == 0
    assert server.metric("neo:request_success_total", finished_reason="abort") >= 100
    assert client.completions.create(model=MODEL, prompt="still alive", max_tokens=2).choices[0].finish_reason


def test_256_concurrent_streams(server: Server) -> None:
    async def one(s: aiohttp.ClientSession, i: int) -> tuple[int, str | None, bool]:
        body = {"model": MODEL, "prompt": f"load {i}", "max_tokens": 12, "stream": True, "ignore_eos": True}
        async with s.post(server.url + "/v1/completions", json=body) as r:
            lines = [line async for line in r.content]
        events = [e for e in b"".join(lines).split(b"\n\n") if e]
        done = events[-1] == b"data: [DONE]"
        last = json.loads(events[-2].removeprefix(b"data: "))["choices"][0]["finish_reason"]
        return r.status, last, done

    async def run() -> list[tuple[int, str | None, bool]]:
        conn = aiohttp.TCPConnector(limit=0)
        async with aiohttp.ClientSession(connector=conn, timeout=aiohttp.ClientTimeout(total=600)) as s:
            return await asyncio.gather(*(one(s, i) for i in range(256)))

    results = asyncio.run(run())
    assert all(r == (200, "length", True) for r in results), [
        r for r in results if r != (200, "length", True)
    ][:5]


def test_api_key_and_backpressure() -> None:
    s = Server("--api-key", "sekrit", "--max-num-seqs", "1", "--max-waiting", "0")
    try:
        bad_key = openai.OpenAI(base_url=s.url + "/v1", api_key="wrong", max_retries=0)
        with pytest.raises(openai.AuthenticationError):
            bad_key.models.list()
        status, body = asyncio.run(_send(s.url + "/v1/models", "GET", None))
        assert status == 401 and body["error"]["code"] == 401
        assert asyncio.run(_send(s.url + "/health", "GET", None))[0] == 200
        good = openai.OpenAI(base_url=s.url + "/v1", api_key="sekrit", max_retries=0)

        async def burst() -> list[int]:
            body = {"model": MODEL, "prompt": "busy", "max_tokens": 200, "ignore_eos": True}
            headers = {"Authorization": "Bearer sekrit"}
            async with aiohttp.ClientSession() as sess:

                async def post() -> int:
                    async with sess.post(s.url + "/v1/completions", json=body, headers=headers) as r:
                        await r.read()
                        return r.status

                return await asyncio.gather(*(post() for _ in range(4)))

        statuses = asyncio.run(burst())
        assert statuses.count(200) >= 1 and statuses.count(429) >= 1, statuses
        assert good.completions.create(model=MODEL, prompt="ok", max_tokens=1).choices
    finally:
        assert s.stop() == 0


def test_sigterm_finishes_running_streams_then_exits_0() -> None:
    s = Server("--shutdown-timeout", "300")

    async def stream(i: int) -> str | None:
        body = {
            "model": MODEL,
            "prompt": f"drain {i}",
            "max_tokens": 600,
            "stream": True,
            "ignore_eos": True,
        }
        async with aiohttp.ClientSession() as sess, sess.post(s.url + "/v1/completions", json=body) as r:
            finish = None
            async for line in r.content:
                if line.startswith(b"data: {"):
                    finish = json.loads(line.removeprefix(b"data: "))["choices"][0]["finish_reason"] or finish
            return finish

    async def run() -> list[str | None]:
        tasks = [asyncio.create_task(stream(i)) for i in range(4)]
        await asyncio.sleep(1.0)
        s.proc.send_signal(signal.SIGTERM)
        await asyncio.sleep(0.3)
        async with aiohttp.ClientSession() as sess, sess.get(s.url + "/health") as r:
            assert r.status == 503
        return await asyncio.gather(*tasks)

    assert asyncio.run(run()) == ["length"] * 4
    assert s.proc.wait(60) == 0


def test_bad_flags_exit_2_with_one_line() -> None:
    r = subprocess.run(
        [sys.executable, "-m", "neo_rs.serve", "--offload", "sometimes"], capture_output=True, text=True
    )
    assert r.returncode == 2 and len(r.stderr.strip().splitlines()) == 1 and "--offload" in r.stderr
