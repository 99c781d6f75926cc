"""``GET /openapi.json`` is generated from the pydantic models, real responses conform to it, and
Schemathesis, reading it, finds nothing with every check on (a bounded run; the long one is
``benches/fuzz_server.sh``). Each finding of the fuzzer has a regression test here."""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import jsonschema
import pytest
import requests
from neo_rs.serve.openapi import ModelList
from neo_rs.serve.protocol import ChatBody, CompletionBody
from server_util import Server

MODEL = "neo-rs-demo"
ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def server() -> Iterator[Server]:
    s = Server("--max-model-len", "128", "--max-num-seqs", "16")
    yield s
    assert s.stop() == 0


@pytest.fixture(scope="module")
def doc(server: Server) -> dict:
    return requests.get(server.url + "/openapi.json", timeout=10).json()


def conforms(doc: dict, name: str, body: object) -> None:
    """``body`` against component ``name``, its references resolved in the document."""
    schema = {"$ref": f"#/components/schemas/{name}", "components": doc["components"]}
    jsonschema.validate(body, schema)


def test_the_document_is_the_models(doc: dict) -> None:
    schemas = doc["components"]["schemas"]
    for model in (CompletionBody, ChatBody):
        fields = {f.alias or name for name, f in model.model_fields.items()}
        assert set(schemas[model.__name__]["properties"]) == fields
    assert doc["paths"]["/v1/models"]["get"]["responses"]["200"]["content"]["application/json"]["schema"] == {
        "$ref": "#/components/schemas/ModelList"
    }
    assert set(schemas["ModelList"]["properties"]) == set(ModelList.model_fields)


def test_the_document_states_each_roles_message(doc: dict) -> None:
    # Schemathesis warned that most chat requests it drew from one message model were refused:
    # the rules per role lived only in code. Each role is a model of its own now.
    def valid(message: dict) -> bool:
        try:
            conforms(doc, "ChatBody", {"messages": [message]})
        except jsonschema.ValidationError:
            return False
        return True

    assert valid({"role": "user", "content": "x"})
    assert valid({"role": "tool", "content": "x", "tool_call_id": "a"})
    assert valid(
        {
            "role": "assistant",
            "tool_calls": [{"id": "a", "type": "function", "function": {"name": "f", "arguments": "{}"}}],
        }
    )
    assert not valid({"role": "tool", "content": "x"})  # which call it answers
    assert not valid({"role": "user"})
    assert not valid({"role": "user", "content": "x", "tool_call_id": "a"})
    assert not valid({"role": "system", "content": "x", "tool_calls": []})


def test_a_field_another_role_takes_is_named(server: Server) -> None:
    body = {"model": MODEL, "messages": [{"role": "user", "content": "x", "tool_call_id": "a"}]}
    r = requests.post(server.url + "/v1/chat/completions", json=body, timeout=30)
    assert (
        r.status_code == 400
        and "'messages.0.user.tool_call_id' is not supported" in r.json()["error"]["message"]
    )


def test_real_responses_conform(server: Server, doc: dict) -> None:
    url = server.url
    completion = requests.post(
        url + "/v1/completions",
        json={"model": MODEL, "prompt": "hi", "max_tokens": 4, "logprobs": 2, "n": 2},
        timeout=30,
    ).json()
    conforms(doc, "Completion", completion)
    chat = requests.post(
        url + "/v1/chat/completions",
        json={
            "model": MODEL,
            "messages": [{"role": "user", "content": "hi"}],
            "max_tokens": 4,
            "logprobs": True,
            "top_logprobs": 2,
        },
        timeout=30,
    ).json()
    conforms(doc, "ChatCompletion", chat)
    conforms(doc, "ModelList", requests.get(url + "/v1/models", timeout=10).json())
    conforms(doc, "Health", requests.get(url + "/health", timeout=10).json())
    conforms(doc, "Version", requests.get(url + "/version", timeout=10).json())
    error = requests.post(url + "/v1/completions", json={"prompt": 5}, timeout=10)
    assert error.status_code == 400
    conforms(doc, "ErrorResponse", error.json())


def test_a_wrong_method_says_which_are_allowed(server: Server) -> None:
    # Schemathesis' first finding (ST204): a 405 without its Allow header (RFC 9110).
    r = requests.request("TRACE", server.url + "/v1/models", timeout=10)
    assert r.status_code == 405 and "GET" in r.headers["Allow"].split(",")
    assert r.json()["error"]["code"] == 405


def test_schemathesis_finds_nothing(server: Server) -> None:
    """Every check, a bounded number of examples per operation, a fixed seed, loopback only."""
    cmd = [
        str(Path(sys.executable).parent / "st"),
        "--config-file",
        str(ROOT / "benches" / "schemathesis.toml"),
        "run",
        server.url + "/openapi.json",
        "--checks",
        "all",
        "--max-examples",
        "25",
        "--request-timeout",
        "60",
        "--seed",
        "1",
        "--no-color",
    ]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stdout[-6000:] + out.stderr[-2000:]
    assert "passed" in out.stdout
