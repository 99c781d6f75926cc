"""Tool calling: the parsers on fixed text (whole and streamed in random pieces), and through the
server on the demo model (random weights): ``required`` and named functions always give calls
whose arguments match their schemas, streamed or not; ``auto`` finds hermes calls; follow-up turns
with ``tool`` messages work; bad tool requests are 400s."""

from __future__ import annotations

import json
import random
from collections.abc import Iterator
from typing import Any

import jsonschema
import openai
import pytest
from neo_rs.serve.tools import ToolChoice, ToolStream, scan
from server_util import Server

MODEL = "neo-rs-demo"
WEATHER = {
    "type": "object",
    "properties": {
        "city": {"enum": ["Paris", "Oslo", "Lima"]},
        "days": {"type": "integer", "minimum": 1, "maximum": 7},
    },
    "required": ["city", "days"],
    "additionalProperties": False,
}
CONVERT = {
    "type": "object",
    "properties": {
        "amount": {"type": "number", "minimum": 0, "maximum": 1000},
        "to": {"enum": ["EUR", "USD"]},
    },
    "required": ["amount"],
    "additionalProperties": False,
}
TOOLS = [
    {
        "type": "function",
        "function": {"name": "get_weather", "description": "forecast", "parameters": WEATHER},
    },
    {"type": "function", "function": {"name": "convert", "parameters": CONVERT}},
]
SCHEMAS = {"get_weather": WEATHER, "convert": CONVERT}


def _pieces(text: str, rng: random.Random) -> list[str]:
    cuts = (
        sorted(rng.sample(range(1, len(text)), min(len(text) - 1, rng.randint(1, 12))))
        if len(text) > 1
        else []
    )
    return [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)], strict=True)]


def _streamed(
    choice: ToolChoice, parser: str | None, text: str, seed: int
) -> tuple[str, list[tuple[str, str]]]:
    stream = ToolStream(choice, parser)
    content, calls = "", []
    parts = _pieces(text, random.Random(seed))
    for i, part in enumerate(parts):
        c, new = stream.feed(part, final=i == len(parts) - 1)
        content += c
        calls += [(x["function"]["name"], x["function"]["arguments"]) for x in new]
    return content, calls


@pytest.mark.parametrize(
    ("parser", "text", "content", "calls"),
    [
        ("hermes", "plain reply, no < tags", "plain reply, no < tags", []),
        (
            "hermes",
            'Let me look.<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo", "days": 2}}'
            "\n</tool_call>"
            '<tool_call>{"name": "convert", "arguments": {"amount": 3}}</tool_call>',
            "Let me look.",
            [("get_weather", '{"city": "Oslo", "days": 2}'), ("convert", '{"amount": 3}')],
        ),
        (
            "hermes",
            '<tool_call>{"name": "convert", "arguments": {"amount": 1}}',
            "",
            [("convert", '{"amount": 1}')],
        ),
        ("hermes", "<tool_call>not json</tool_call>", "", []),
        ("llama3_json", "The answer is 4.", "The answer is 4.", []),
        (
            "llama3_json",
            '<|python_tag|>{"name": "get_weather", "parameters": {"city": "Lima", "days": 1}}; '
            '{"name": "convert", "parameters": {"amount": 2.5, "to": "EUR"}}',
            "",
            [("get_weather", '{"city": "Lima", "days": 1}'), ("convert", '{"amount": 2.5, "to": "EUR"}')],
        ),
        ("llama3_json", '{"not": "a call"}', '{"not": "a call"}', []),
        ("llama3_json", "{broken", "{broken", []),
    ],
)
def test_parsers_whole_and_streamed(
    parser: str, text: str, content: str, calls: list[tuple[str, str]]
) -> None:
    choice = ToolChoice("auto", TOOLS)
    found = scan(choice, parser, text, final=True)
    assert (text[: found.content_end], found.calls) == (content, calls)
    for seed in range(20):
        assert _streamed(choice, parser, text, seed) == (content, calls)


def test_forced_replies_parse_at_the_end_and_stay_content_when_cut() -> None:
    required = ToolChoice("required", TOOLS)
    text = '[{"name": "convert", "parameters": {"amount": 5}}]'
    assert _streamed(required, None, text, 0) == ("", [("convert", '{"amount": 5}')])
    assert _streamed(required, None, text[:-3], 0) == (text[:-3], [])  # cut by max_tokens
    named = ToolChoice("named", TOOLS, "get_weather")
    assert _streamed(named, None, '{"city": "Paris", "days": 3}', 1) == (
        "",
        [("get_weather", '{"city": "Paris", "days": 3}')],
    )


# -- through the server ---------------------------------------------------------------------


@pytest.fixture(scope="module")
def server() -> Iterator[Server]:
    s = Server("--max-num-seqs", "64", "--tool-call-parser", "hermes")
    yield s
    assert s.stop() == 0


@pytest.fixture(scope="module")
def client(server: Server) -> openai.OpenAI:
    return server.client()


def _chat(client: openai.OpenAI, stream: bool, **kw: Any) -> list[dict[str, Any]]:
    """Each choice's message (content, tool_calls as dicts) and finish_reason, from a whole
    response or reassembled from the stream's deltas."""
    kw = {"model": MODEL, "max_tokens": 400, "temperature": 0, **kw}
    if not stream:
        resp = client.chat.completions.create(**kw)
        return [
            {
                "content": c.message.content,
                "tool_calls": [
                    (t.id, t.function.name, t.function.arguments) for t in c.message.tool_calls or []
                ],
                "finish_reason": c.finish_reason,
            }
            for c in sorted(resp.choices, key=lambda c: c.index)
        ]
    out: dict[int, dict[str, Any]] = {}
    for chunk in client.chat.completions.create(**kw, stream=True):
        for c in chunk.choices:
            o = out.setdefault(c.index, {"content": "", "calls": {}, "finish_reason": None})
            o["content"] += c.delta.content or ""
            for t in c.delta.tool_calls or []:
                call = o["calls"].setdefault(t.index, ["", "", ""])
                call[0] += t.id or ""
                call[1] += (t.function.name or "") if t.function else ""
                call[2] += (t.function.arguments or "") if t.function else ""
            o["finish_reason"] = c.finish_reason or o["finish_reason"]
    return [
        {
            "content": o["content"] or None,
            "tool_calls": [tuple(o["calls"][i]) for i in sorted(o["calls"])],
            "finish_reason": o["finish_reason"],
        }
        for _, o in sorted(out.items())
    ]


def _same_calls(a: list[dict[str, Any]], b: list[dict[str, Any]]) -> None:
    """Whole and streamed replies carry the same calls (ids differ between responses)."""
    strip = [[(n, args) for _, n, args in m["tool_calls"]] for m in a]
    assert strip == [[(n, args) for _, n, args in m["tool_calls"]] for m in b]
    assert [m["finish_reason"] for m in a] == [m["finish_reason"] for m in b]


@pytest.mark.parametrize("seed", range(3))
def test_required_gives_valid_calls_streamed_or_not(client: openai.OpenAI, seed: int) -> None:
    msgs = [{"role": "user", "content": f"weather or money? ({seed})"}]
    kw = {
        "messages": msgs,
        "tools": TOOLS,
        "tool_choice": "required",
        "seed": seed,
        "temperature": 1.0,
        "n": 2,
        "max_tokens": 1500,  # parallel calls run long on a byte-level vocabulary
    }
    whole, streamed = _chat(client, False, **kw), _chat(client, True, **kw)
    _same_calls(whole, streamed)
    for m in whole + streamed:
        assert m["finish_reason"] == "tool_calls" and m["tool_calls"] and m["content"] is None
        for call_id, name, args in m["tool_calls"]:
            assert call_id.startswith("chatcmpl-tool-")
            jsonschema.validate(json.loads(args), SCHEMAS[name])


def test_named_function_and_a_follow_up_turn(client: openai.OpenAI) -> None:
    msgs: list[dict[str, Any]] = [{"role": "user", "content": "weather in Oslo?"}]
    named = {"type": "function", "function": {"name": "get_weather"}}
    kw = {"messages": msgs, "tools": TOOLS, "tool_choice": named, "parallel_tool_calls": False}
    whole, streamed = _chat(client, False, **kw), _chat(client, True, **kw)
    _same_calls(whole, streamed)
    [(call_id, name, args)] = whole[0]["tool_calls"]
    assert name == "get_weather" and whole[0]["finish_reason"] == "stop"
    jsonschema.validate(json.loads(args), WEATHER)
    msgs += [
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {"id": call_id, "type": "function", "function": {"name": name, "arguments": args}}
            ],
        },
        {"role": "tool", "tool_call_id": call_id, "content": '{"forecast": "rain"}'},
    ]
    [reply] = _chat(client, False, messages=msgs, tools=TOOLS, tool_choice="none", max_tokens=8)
    assert reply["finish_reason"] == "length" and reply["content"] and not reply["tool_calls"]


def test_auto_finds_hermes_calls(client: openai.OpenAI) -> None:
    # The demo model's random weights would not write a call: a regex makes it write one, so the
    # parser's path through the server runs (the regex is not part of tool calling).
    forced = (
        r'Sure\.<tool_call>\{"name": "get_weather", "arguments": '
        r'\{"city": "(Paris|Oslo)", "days": [1-7]\}\}</tool_call>'
    )
    kw = {
        "messages": [{"role": "user", "content": "hi"}],
        "tools": TOOLS,
        "extra_body": {"guided_regex": forced},
    }
    whole, streamed = _chat(client, False, **kw), _chat(client, True, **kw)
    _same_calls(whole, streamed)
    for m in whole + streamed:
        assert m["content"] == "Sure." and m["finish_reason"] == "tool_calls"
        [(_, name, args)] = m["tool_calls"]
        jsonschema.validate(json.loads(args), WEATHER)
    free = _chat(client, False, messages=[{"role": "user", "content": "hi"}], tools=TOOLS, max_tokens=16)
    assert free[0]["finish_reason"] == "length" and not free[0]["tool_calls"]


def test_auto_needs_a_parser_and_other_bad_tool_requests() -> None:
    s = Server("--max-num-seqs", "8")  # no --tool-call-parser
    try:
        c = s.client()
        msgs = [{"role": "user", "content": "hi"}]
        bad: list[dict[str, Any]] = [
            {"tools": TOOLS},  # auto (the default) without a parser
            {"tool_choice": "required"},  # no tools
            {"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}},
            {"tools": [{"type": "function", "function": {"name": "bad name!"}}], "tool_choice": "required"},
            {"tools": TOOLS + TOOLS[:1], "tool_choice": "required"},
            {"tools": [], "tool_choice": "required"},
            {"tools": TOOLS, "tool_choice": "required", "response_format": {"type": "json_object"}},
            {
                "tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "no-such"}}}],
                "tool_choice": "required",
            },
            {"messages": [{"role": "tool", "content": "x"}]},
            {"messages": [{"role": "user", "content": "x", "tool_call_id": "a"}]},
            {
                "messages": [
                    {
                        "role": "assistant",
                        "tool_calls": [
                            {"id": "a", "type": "function", "function": {"name": "f", "arguments": "{x"}}
                        ],
                    }
                ]
            },
        ]
        for extra in bad:
            body = {"messages": msgs, **extra}
            with pytest.raises(openai.BadRequestError):
                c.chat.completions.create(model=MODEL, max_tokens=4, **body)
        # Required and named calls need no parser.
        ok = c.chat.completions.create(
            model=MODEL,
            messages=msgs,
            tools=TOOLS,
            tool_choice="required",
            parallel_tool_calls=False,
            max_tokens=400,
        )
        assert ok.choices[0].message.tool_calls
    finally:
        assert s.stop() == 0
