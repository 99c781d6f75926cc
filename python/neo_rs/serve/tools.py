"""Tool calling in chat (OpenAI's ``tools`` / ``tool_choice``, vLLM's ``--tool-call-parser``).

- ``required`` and a named function are enforced with a grammar: the model writes a JSON array of
  ``{"name", "parameters"}`` (one of the tools, each with its own schema), or the named function's
  arguments alone, so the calls always parse and match their schemas.
- ``auto`` leaves the model free; a parser finds the calls in what it wrote: ``hermes`` (Qwen,
  Hermes: ``<tool_call>{"name": ..., "arguments": ...}</tool_call>``) or ``llama3_json`` (Llama 3.1:
  the reply is ``{"name": ..., "parameters": ...}``, several joined by ``;``, after an optional
  ``<|python_tag|>``).

Every mode reads the text through one ``scan(text, final)``: where the content ends (text that
may still start a call is held back) and the calls complete so far. ``ToolStream`` turns that
into stream deltas, so streamed and whole responses carry the same calls."""

from __future__ import annotations

import json
import logging
import re
import uuid
from dataclasses import dataclass, field
from typing import Any

from neo_rs.sample.structured import StructuredOutputsParams

log = logging.getLogger(__name__)

PARSERS = ("hermes", "llama3_json")


@dataclass
class ToolChoice:
    """What a request asked for: ``kind`` auto | required | named | none (``name``: the named one)."""

    kind: str
    tools: list[dict[str, Any]]  # OpenAI's tool objects, as sent
    name: str | None = None
    parallel: bool = True

    def schemas(self) -> dict[str, dict[str, Any]]:
        return {
            t["function"]["name"]: t["function"].get("parameters") or {"type": "object"} for t in self.tools
        }

    def grammar(self) -> StructuredOutputsParams | None:
        """The constraint that enforces ``required`` or a named function (None otherwise)."""
        schemas = self.schemas()
        if self.kind == "named":
            assert self.name is not None
            return StructuredOutputsParams(json=schemas[self.name])
        if self.kind != "required":
            return None
        calls = [
            {
                "type": "object",
                "properties": {"name": {"const": name}, "parameters": schema},
                "required": ["name", "parameters"],
                "additionalProperties": False,
            }
            for name, schema in schemas.items()
        ]
        array: dict[str, Any] = {"type": "array", "items": {"anyOf": calls}, "minItems": 1}
        if not self.parallel:
            array["maxItems"] = 1
        return StructuredOutputsParams(json=array)


@dataclass
class Scan:
    content_end: int  # text before this is the reply's content
    calls: list[tuple[str, str]]  # (name, arguments as JSON text), complete ones, in order


def _call(obj: Any, args_key: str) -> tuple[str, str] | None:
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None
    args = obj.get(args_key, obj.get("arguments", {}))
    return obj["name"], args if isinstance(args, str) else json.dumps(args, ensure_ascii=False)


def _held_suffix(text: str, marker: str) -> int:
    """How many characters at the end of ``text`` could be the start of ``marker``."""
    return next((k for k in range(min(len(marker) - 1, len(text)), 0, -1) if marker.startswith(text[-k:])), 0)


_HERMES_OPEN, _HERMES_CLOSE = "<tool_call>", "</tool_call>"
_HERMES_BLOCK = re.compile(r"<tool_call>(.*?)(?:</tool_call>|$)", re.DOTALL)
_PYTHON_TAG = "<|python_tag|>"


def scan_hermes(text: str, final: bool) -> Scan:
    start = text.find(_HERMES_OPEN)
    if start < 0:
        return Scan(len(text) if final else len(text) - _held_suffix(text, _HERMES_OPEN), [])
    calls = []
    for m in _HERMES_BLOCK.finditer(text, start):
        if not m.group(0).endswith(_HERMES_CLOSE) and not final:
            break  # still being written
        try:
            call = _call(json.loads(m.group(1)), "arguments")
        except ValueError:
            call = None
        if call is None:
            log.warning("hermes tool parser: dropped a block that is not a call: %r", m.group(0)[:200])
            continue
        calls.append(call)
    return Scan(start, calls)


def scan_llama3_json(text: str, final: bool) -> Scan:
    body = text.lstrip()
    if not (body.startswith(("{", _PYTHON_TAG)) or _PYTHON_TAG.startswith(body)):
        return Scan(len(text), [])  # plain content
    if not final:
        return Scan(0, [])  # a call, or content that starts like one: wait for the end
    body = body.removeprefix(_PYTHON_TAG).strip()
    calls, decoder, at = [], json.JSONDecoder(), 0
    while at < len(body):
        try:
            obj, at = decoder.raw_decode(body, at)
        except ValueError:
            return Scan(len(text), [])  # not calls after all: all of it is content
        call = _call(obj, "parameters")
        if call is None:
            return Scan(len(text), [])
        calls.append(call)
        while at < len(body) and body[at] in " \t\r\n;":
            at += 1
    return Scan(0, calls)


def scan_forced(choice: ToolChoice, text: str, final: bool) -> Scan:
    """``required`` / named: the whole reply is the calls (parsed when it is complete; a reply cut
    short by ``max_tokens`` stays content)."""
    if not final:
        return Scan(0, [])
    try:
        value = json.loads(text)
    except ValueError:
        return Scan(len(text), [])
    if choice.kind == "named":
        assert choice.name is not None
        return Scan(0, [(choice.name, json.dumps(value, ensure_ascii=False))])
    return Scan(0, [c for item in value if (c := _call(item, "parameters")) is not None])


def scan(choice: ToolChoice, parser: str | None, text: str, final: bool) -> Scan:
    if choice.kind in ("required", "named"):
        return scan_forced(choice, text, final)
    if choice.kind == "auto" and parser == "hermes":
        return scan_hermes(text, final)
    if choice.kind == "auto" and parser == "llama3_json":
        return scan_llama3_json(text, final)
    return Scan(len(text), [])


def new_call_id() -> str:
    return f"chatcmpl-tool-{uuid.uuid4().hex}"


def call_json(call_id: str, name: str, arguments: str) -> dict[str, Any]:
    return {"id": call_id, "type": "function", "function": {"name": name, "arguments": arguments}}


@dataclass
class ToolStream:
    """One choice's reply, fed as it streams: content deltas, and each call once it is complete."""

    choice: ToolChoice
    parser: str | None
    text: str = ""
    sent: int = 0  # content characters handed out
    ids: list[str] = field(default_factory=list)  # the calls handed out

    def feed(self, delta: str, final: bool) -> tuple[str, list[dict[str, Any]]]:
        """New content and new calls (as stream ``tool_calls`` entries, with their index)."""
        self.text += delta
        found = scan(self.choice, self.parser, self.text, final)
        content = self.text[self.sent : max(self.sent, found.content_end)]
        self.sent = max(self.sent, found.content_end)
        new = []
        for name, args in found.calls[len(self.ids) :]:
            self.ids.append(new_call_id())
            new.append({"index": len(self.ids) - 1, **call_json(self.ids[-1], name, args)})
        return content, new

    @property
    def called(self) -> bool:
        return bool(self.ids)

    def finish_reason(self, reason: str | None) -> str | None:
        """vLLM's: calls the model chose to make end in ``tool_calls``; a named one stays ``stop``."""
        if reason == "stop" and self.called and self.choice.kind != "named":
            return "tool_calls"
        return reason
