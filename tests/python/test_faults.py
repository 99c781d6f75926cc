"""A failing iteration (injected through ``NEO_RS_FAIL_STEPS``) fails only its own requests, frees
their KV blocks in both pools and leaves the scheduler ready for the next one; the server turns it
into errors on exactly those streams, and after repeated failures exits non-zero."""

from __future__ import annotations

import asyncio
import json
import time

import aiohttp
import pytest
from conftest import assert_all_blocks_free
from neo_rs import LLMEngine, SamplingParams
from neo_rs.config import EngineArgs
from neo_rs.errors import EngineStepError
from neo_rs.worker.faults import parse_calls
from server_util import Server

GREEDY = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)


def test_fail_steps_spec() -> None:
    assert parse_calls("") == frozenset()
    assert parse_calls("5, 9-11") == {5, 9, 10, 11}
    with pytest.raises(ValueError, match="NEO_RS_FAIL_STEPS"):
        parse_calls("five")


@pytest.mark.parametrize("offload", ["none", "neo", "all"])
def test_failed_step_aborts_its_requests_and_the_engine_goes_on(
    checkpoints, monkeypatch: pytest.MonkeyPatch, offload: str
) -> None:
    monkeypatch.setenv("NEO_RS_FAIL_STEPS", "4")
    # A device pool too small for all six: swaps (none), host decodes (neo, all) are in flight.
    args = EngineArgs(
        model=str(checkpoints["llama"]),
        dtype="float32",
        offload=offload,
        num_gpu_blocks=12,
        num_cpu_blocks=64,
        block_size=8,
        neo_force_pipeline=True,
    )
    engine = LLMEngine(args)
    ids = [engine.add_request(list(range(3, 30 + i)), GREEDY) for i in range(6)]
    for _ in range(3):
        engine.step()
    with pytest.raises(EngineStepError) as failure:
        engine.step()
    failed = failure.value.request_ids
    assert failed and set(failed) <= set(ids)
    engine.scheduler.check_invariants()
    finished = {}
    while engine.has_unfinished():
        for out in engine.step():
            if out.finished:
                finished[out.request_id] = out.outputs[0]
    assert set(finished) == set(ids) - set(failed)
    assert all(len(o.token_ids) == 8 and o.finish_reason == "length" for o in finished.values())
    assert_all_blocks_free(engine)
    later = engine.add_request([5, 6, 7], GREEDY)
    outs = [o for _ in range(20) for o in engine.step() if o.finished]
    assert [o.request_id for o in outs] == [later]
    assert_all_blocks_free(engine)


def post(url: str, body: dict) -> tuple[int, dict]:
    """POST /v1/completions; (status, JSON body)."""

    async def run() -> tuple[int, dict]:
        async with aiohttp.ClientSession() as s, s.post(url + "/v1/completions", json=body) as r:
            return r.status, await r.json()

    return asyncio.run(run())


def _events(lines: list[bytes]) -> list[bytes]:
    return [e for e in b"".join(lines).split(b"\n\n") if e]


async def _stream(s: aiohttp.ClientSession, url: str, i: int) -> tuple[str, list[bytes]]:
    # Even streams are short (done long before model run 30), odd ones long (running through it).
    max_tokens = 4 if i % 2 == 0 else 120
    body = {"prompt": f"fault {i}", "max_tokens": max_tokens, "stream": True, "ignore_eos": True}
    async with s.post(url + "/v1/completions", json=body) as r:
        assert r.status == 200
        events = _events([line async for line in r.content])
    assert events[-1] == b"data: [DONE]", events[-3:]
    last = json.loads(events[-2].removeprefix(b"data: "))
    if "error" in last:
        assert last["error"]["code"] == 500 and "injected fault" in last["error"]["message"]
        return "error", events
    assert last["choices"][0]["finish_reason"] == "length"
    return "length", events


def _open_streams(url: str, n: int) -> list[str]:
    async def run() -> list[str]:
        timeout = aiohttp.ClientTimeout(total=120)
        async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0), timeout=timeout) as s:
            return [kind for kind, _ in await asyncio.gather(*(_stream(s, url, i) for i in range(n)))]

    return asyncio.run(run())


def test_server_fault_with_32_streams_open() -> None:
    # Run 12 is well inside the 32 streams' decoding (they arrive over the first few runs).
    server = Server("--max-num-seqs", "64", env={"NEO_RS_FAIL_STEPS": "30"})
    try:
        kinds = _open_streams(server.url, 32)
        assert kinds == ["length", "error"] * 16, kinds
        deadline = time.monotonic() + 10
        used = -1.0
        while time.monotonic() < deadline and used != 0:
            used = server.metric("neo:kv_blocks_used", pool="gpu") + server.metric(
                "neo:kv_blocks_used", pool="cpu"
            )
            time.sleep(0.1)
        assert used == 0
        status, body = post(server.url, {"prompt": "after", "max_tokens": 4, "ignore_eos": True})
        assert status == 200 and body["choices"][0]["finish_reason"] == "length"
    finally:
        assert server.stop() == 0


def test_server_fault_non_streaming_is_a_500_with_an_openai_body() -> None:
    server = Server(env={"NEO_RS_FAIL_STEPS": "1"})
    try:
        status, body = post(server.url, {"prompt": "x", "max_tokens": 4, "ignore_eos": True})
        assert status == 500 and body["error"]["type"] == "InternalServerError"
        assert post(server.url, {"prompt": "x", "max_tokens": 4, "ignore_eos": True})[0] == 200
    finally:
        assert server.stop() == 0


def test_repeated_failures_make_the_server_exit_non_zero() -> None:
    server = Server(env={"NEO_RS_FAIL_STEPS": "1-1000"})
    for _ in range(3):
        assert post(server.url, {"prompt": "x", "max_tokens": 4, "ignore_eos": True})[0] == 500
    assert server.proc.wait(60) == 1
    assert "exiting with status 1" in server.log.read_text()
