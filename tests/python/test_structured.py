"""Structured outputs: JSON Schemas, JSON objects, regexes, choices and grammars hold on every
output, whatever the weights (the demo model's are random), offline and through the server,
streaming and not; free requests beside constrained ones keep their tokens; matchers are released."""

from __future__ import annotations

import asyncio
import json
import random
import re
from collections.abc import Iterator
from typing import Any, Literal

import aiohttp
import jsonschema
import openai
import pytest
from neo_rs import LLM, SamplingParams
from neo_rs.errors import InvalidArgumentError
from neo_rs.sample.structured import StructuredOutputsParams
from pydantic import BaseModel, Field
from server_util import Server

MODEL = "neo-rs-demo"
NAMES = ["id", "name", "tags", "score", "ok", "kind", "items", "meta", "n", "note"]
# Long enough for any output of the schemas below (strings and arrays are bounded): an output
# cut by max_tokens would be incomplete JSON, and this test would report it.
MAX_TOKENS = 400


def random_schema(rng: random.Random, depth: int = 0) -> dict[str, Any]:
    """A random JSON Schema: nested objects with required and optional keys, arrays, enums,
    bounded integers and numbers, bounded strings, booleans and null."""
    kinds = ["integer", "number", "string", "boolean", "enum", "null"]
    kinds += ["object", "array"] * (2 - depth) if depth < 2 else []
    kind = rng.choice(kinds) if depth else "object"
    if kind == "object":
        names = rng.sample(NAMES, rng.randint(1, 4))
        return {
            "type": "object",
            "properties": {n: random_schema(rng, depth + 1) for n in names},
            "required": [n for n in names if rng.random() < 0.6],
            "additionalProperties": False,
        }
    if kind == "array":
        lo = rng.randint(0, 2)
        return {"type": "array", "items": random_schema(rng, depth + 1), "minItems": lo, "maxItems": lo + 2}
    if kind == "integer":
        lo = rng.randint(-1000, 1000)
        return {"type": "integer", "minimum": lo, "maximum": lo + rng.randint(0, 500)}
    if kind == "number":
        lo = rng.uniform(-100, 100)
        return {"type": "number", "minimum": round(lo, 2), "maximum": round(lo + rng.uniform(1, 50), 2)}
    if kind == "string":
        lo = rng.randint(0, 2)
        return {"type": "string", "minLength": lo, "maxLength": lo + rng.randint(0, 6)}
    if kind == "enum":
        pool: list[Any] = ["red", "green", "blue", 'say "hi"', 7, -3, True, None]
        return {"enum": rng.sample(pool, rng.randint(1, 4))}
    return {"type": kind}


SCHEMAS = [random_schema(random.Random(seed)) for seed in range(50)]


def check_json(text: str, schema: dict[str, Any]) -> None:
    jsonschema.validate(json.loads(text), schema)


@pytest.fixture(scope="module")
def llm() -> LLM:
    return LLM(max_num_seqs=128)


def params(**so: Any) -> SamplingParams:
    return SamplingParams(temperature=1.0, seed=0, n=2, max_tokens=MAX_TOKENS, structured_outputs=so)


def test_random_json_schemas_hold_offline(llm: LLM) -> None:
    outs = llm.generate(
        [f"record {i}:" for i in range(len(SCHEMAS))], [params(json=s) for s in SCHEMAS], use_tqdm=False
    )
    for schema, out in zip(SCHEMAS, outs, strict=True):
        assert len(out.outputs) == 2
        for o in out.outputs:
            assert o.finish_reason == "stop", (schema, o.text)
            check_json(o.text, schema)
    assert llm.engine.grammars is not None and llm.engine.grammars.active == 0


def test_choice_regex_grammar_and_json_object(llm: LLM) -> None:
    # (Any JSON object's keys and strings are unbounded: random weights write ~300 tokens of them.)
    choices = ["yes", "no", 'a "quoted" one', "ünïcödé"]
    regex = r"[a-f]{2,4}-[0-9]{1,3}(\.[0-9])?"
    lark = 'start: "(" item ("," item)* ")"\nitem: /[xyz]/ | start'
    gbnf = 'root ::= "<" [0-9] [0-9]? ">"'
    cases: list[tuple[dict[str, Any], Any]] = [
        ({"choice": choices}, lambda t: t in choices),
        ({"regex": regex}, lambda t: re.fullmatch(regex, t)),
        ({"grammar": lark}, lambda t: re.fullmatch(r"[()xyz,]+", t) and t.count("(") == t.count(")")),
        ({"grammar": gbnf}, lambda t: re.fullmatch(r"<[0-9]{1,2}>", t)),
        ({"json_object": True}, lambda t: isinstance(json.loads(t), dict)),
    ]
    for seed in range(4):
        ps = [
            SamplingParams(temperature=1.0, seed=seed, n=2, max_tokens=1500, structured_outputs=so)
            for so, _ in cases
        ]
        outs = llm.generate([f"p{seed}"] * len(cases), ps, use_tqdm=False)
        for (so, ok), out in zip(cases, outs, strict=True):
            for o in out.outputs:
                assert o.finish_reason == "stop" and ok(o.text), (so, o.text)


def test_free_requests_keep_their_tokens_beside_constrained_ones(llm: LLM) -> None:
    free = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    prompts = ["the first free one", "another free prompt", "x"]
    alone = llm.generate(prompts, free, use_tqdm=False)
    constrained = [params(json=s) for s in SCHEMAS[:6]]
    mixed = llm.generate(
        prompts + [f"c{i}" for i in range(6)], [free] * len(prompts) + constrained, use_tqdm=False
    )
    for a, m in zip(alone, mixed[: len(prompts)], strict=True):
        assert a.outputs[0].token_ids == m.outputs[0].token_ids


def test_min_tokens_yield_to_a_finished_grammar(llm: LLM) -> None:
    # The grammar allows only EOS after "yes"; min_tokens must not force anything else.
    p = SamplingParams(temperature=0, max_tokens=20, min_tokens=10, structured_outputs={"choice": ["yes"]})
    out = llm.generate("q", p, use_tqdm=False)[0].outputs[0]
    assert out.text == "yes" and out.finish_reason == "stop"


def test_grammar_completion_stops_even_with_ignore_eos(llm: LLM) -> None:
    p = SamplingParams(temperature=0, max_tokens=50, ignore_eos=True, structured_outputs={"regex": "ab?c"})
    out = llm.generate("q", p, use_tqdm=False)[0].outputs[0]
    assert out.text in ("ac", "abc") and out.finish_reason == "stop"


def test_masks_are_computed_while_the_model_runs(llm: LLM) -> None:
    engine = llm.engine
    assert engine.grammars is not None
    seen: list[int] = []
    execute = engine.runner.execute

    def spy(plan: Any) -> Any:
        seen.append(engine.grammars.masks_started)  # type: ignore[union-attr]
        return execute(plan)

    engine.runner.execute = spy  # type: ignore[method-assign]
    try:
        before = engine.grammars.masks_started
        llm.generate(
            "q", SamplingParams(max_tokens=4, structured_outputs={"regex": "[a-z]{4}"}), use_tqdm=False
        )
    finally:
        del engine.runner.execute
    # Every forward of the request began after that step's masks were under way.
    assert seen and seen == list(range(before + 1, before + 1 + len(seen)))


def test_matchers_are_released_on_abort_and_on_bad_requests(llm: LLM) -> None:
    engine = llm.engine
    assert engine.grammars is not None
    rid = engine.add_request("q", SamplingParams(n=3, max_tokens=50, structured_outputs={"regex": "[a-z]+"}))
    engine.step()
    assert engine.grammars.active == 3
    engine.abort(rid)
    assert engine.grammars.active == 0
    with pytest.raises(InvalidArgumentError, match="regex"):
        engine.add_request("q", SamplingParams(structured_outputs={"regex": "(unclosed"}))
    with pytest.raises(InvalidArgumentError):  # n beyond max_num_seqs: refused after nothing was taken
        engine.add_request("q", SamplingParams(n=1000, structured_outputs={"regex": "a"}))
    assert engine.grammars.active == 0 and not engine.has_unfinished()


@pytest.mark.parametrize(
    "fields",
    [
        {},
        {"regex": "a", "choice": ["a"]},
        {"json": "{oops"},
        {"json": [1]},
        {"choice": []},
        {"choice": ["a", 1]},
        {"grammar": ""},
        {"json_object": False},
    ],
)
def test_bad_structured_outputs_are_typed_errors(fields: dict[str, Any]) -> None:
    with pytest.raises(InvalidArgumentError):
        StructuredOutputsParams(**fields)


def test_an_empty_schema_allows_any_json(llm: LLM) -> None:
    so = StructuredOutputsParams(json={})
    assert so.kind == "json"
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, structured_outputs=so)
    out = llm.generate("any", params, use_tqdm=False)[0]
    assert out.outputs[0].finish_reason == "stop"
    json.loads(out.outputs[0].text)


# -- through the server ---------------------------------------------------------------------


@pytest.fixture(scope="module")
def server() -> Iterator[Server]:
    s = Server("--max-num-seqs", "128")
    yield s
    assert s.stop() == 0


@pytest.fixture(scope="module")
def client(server: Server) -> openai.OpenAI:
    return server.client()


async def _chat(session: aiohttp.ClientSession, url: str, body: dict[str, Any]) -> list[str]:
    """Each choice's content, reassembled from the stream when ``body`` streams."""
    async with session.post(url + "/v1/chat/completions", json=body) as r:
        assert r.status == 200, await r.text()
        if not body.get("stream"):
            return [
                c["message"]["content"] for c in sorted((await r.json())["choices"], key=lambda c: c["index"])
            ]
        parts: dict[int, str] = {}
        async for line in r.content:
            if line.startswith(b"data: ") and line.strip() != b"data: [DONE]":
                for c in json.loads(line[6:])["choices"]:
                    parts[c["index"]] = parts.get(c["index"], "") + (c["delta"].get("content") or "")
        return [parts[i] for i in sorted(parts)]


def test_random_json_schemas_hold_through_the_server_streaming_and_not(server: Server) -> None:
    def body(i: int, schema: dict[str, Any], stream: bool) -> dict[str, Any]:
        fmt = {"type": "json_schema", "json_schema": {"name": f"s{i}", "schema": schema, "strict": True}}
        return {
            "model": MODEL,
            "messages": [{"role": "user", "content": f"record {i}"}],
            "response_format": fmt,
            "n": 2,
            "temperature": 1.0,
            "seed": i,
            "max_tokens": MAX_TOKENS,
            "stream": stream,
        }

    async def run() -> list[list[str]]:
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=600)) as s:
            jobs = [
                _chat(s, server.url, body(i, sc, st)) for st in (False, True) for i, sc in enumerate(SCHEMAS)
            ]
            return await asyncio.gather(*jobs)

    results = asyncio.run(run())
    for schema, texts in zip(SCHEMAS + SCHEMAS, results, strict=True):
        assert len(texts) == 2
        for text in texts:
            check_json(text, schema)


def test_guided_fields_and_structured_outputs_on_completions(client: openai.OpenAI) -> None:
    choices = ["left", "right"]
    for extra, ok in [
        ({"guided_choice": choices}, lambda t: t in choices),
        ({"structured_outputs": {"choice": choices}}, lambda t: t in choices),
        ({"guided_regex": "[0-9]{3}"}, lambda t: re.fullmatch("[0-9]{3}", t)),
        (
            {"guided_json": {"type": "array", "items": {"type": "boolean"}, "maxItems": 3}},
            lambda t: json.loads(t),
        ),
        ({"response_format": {"type": "json_object"}}, lambda t: isinstance(json.loads(t), dict)),
    ]:
        for stream in (False, True):
            kw = {"model": MODEL, "prompt": "go", "max_tokens": 1500, "temperature": 1.0, "n": 2, "seed": 1}
            if stream:
                texts = ["", ""]
                for chunk in client.completions.create(**kw, stream=True, extra_body=extra):
                    for c in chunk.choices:
                        texts[c.index] += c.text
            else:
                texts = [c.text for c in client.completions.create(**kw, extra_body=extra).choices]
            for t in texts:
                assert ok(t) is not None and ok(t) is not False, (extra, t)


class Pet(BaseModel):
    kind: Literal["cat", "dog", "fish"]
    age: int = Field(ge=0, le=30)
    vaccinated: bool
    tags: list[Literal["small", "loud"]] = Field(max_length=2)


def test_openai_parse_returns_a_parsed_object(client: openai.OpenAI) -> None:
    resp = client.chat.completions.parse(
        model=MODEL,
        messages=[{"role": "user", "content": "describe a pet"}],
        response_format=Pet,
        max_tokens=MAX_TOKENS,
        temperature=0,
    )
    pet = resp.choices[0].message.parsed
    assert isinstance(pet, Pet) and 0 <= pet.age <= 30
