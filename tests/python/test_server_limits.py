"""Slow and hostile clients, and the documented limits (README, docs/serving.md): a client that
sends its headers or body a byte at a time is cut off after ``--request-timeout``; past
``--max-connections`` open connections requests get 503; a stream nobody reads is dropped and its
request aborted; too many stop strings, a prompt past the context, ``n`` past ``max_num_seqs``
and ``max_tokens`` past the context are each a 400 naming the limit."""

from __future__ import annotations

import json
import socket
import time
from collections.abc import Iterator

import pytest
import requests
from neo_rs.sample.sampling import MAX_STOP_STRINGS
from neo_rs.serve.cli import parse_args
from server_util import Server

MODEL = "neo-rs-demo"
TIMEOUT = 1.0


@pytest.fixture(scope="module")
def server() -> Iterator[Server]:
    s = Server("--request-timeout", str(TIMEOUT), "--max-connections", "6", "--max-num-seqs", "8")
    yield s
    assert s.stop() == 0


def connect(server: Server, rcvbuf: int | None = None) -> socket.socket:
    sock = socket.socket()
    if rcvbuf is not None:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, rcvbuf)
    sock.connect(("127.0.0.1", server.port))
    return sock


def closed_within(sock: socket.socket, seconds: float, trickle: bytes = b"") -> tuple[bool, bytes]:
    """Send ``trickle`` a byte every 0.2 s (then wait) until the server closes the connection or
    ``seconds`` pass; whether it closed, and what it answered."""
    sock.settimeout(0.2)
    got, deadline, sent = b"", time.monotonic() + seconds, 0
    while time.monotonic() < deadline:
        try:
            if sent < len(trickle):
                sock.send(trickle[sent : sent + 1])
                sent += 1
            chunk = sock.recv(65536)
            if not chunk:
                return True, got
            got += chunk
        except TimeoutError:
            continue
        except (ConnectionResetError, BrokenPipeError):
            return True, got
    return False, got


def post(server: Server, body: dict) -> requests.Response:
    return requests.post(server.url + "/v1/completions", json={"model": MODEL, **body}, timeout=30)


def test_headers_a_byte_at_a_time_are_cut_off(server: Server) -> None:
    head = (
        b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n" + b"X-Pad: a" * 50
    )
    with connect(server) as sock:
        closed, _ = closed_within(sock, 10 * TIMEOUT, head)
    assert closed
    assert post(server, {"prompt": "still here", "max_tokens": 2}).status_code == 200


def test_a_body_a_byte_at_a_time_gets_408(server: Server) -> None:
    body = json.dumps({"model": MODEL, "prompt": "slow", "max_tokens": 2}).encode()
    head = f"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: {len(body)}\r\n\r\n".encode()
    with connect(server) as sock:
        sock.sendall(head)
        closed, answer = closed_within(sock, 10 * TIMEOUT, body)
    assert answer.startswith(b"HTTP/1.1 408"), answer[:200]
    error = json.loads(answer.split(b"\r\n\r\n", 1)[1])["error"]
    assert "--request-timeout" in error["message"]
    assert closed


def test_past_max_connections_requests_get_503(server: Server) -> None:
    idle = [connect(server) for _ in range(6)]
    try:
        time.sleep(0.3)  # accepted
        r = post(server, {"prompt": "one too many", "max_tokens": 2})
        assert r.status_code == 503 and "--max-connections" in r.json()["error"]["message"]
    finally:
        for sock in idle:
            sock.close()
    time.sleep(0.3)
    assert post(server, {"prompt": "room again", "max_tokens": 2}).status_code == 200


def test_a_stream_nobody_reads_is_dropped_and_aborted(server: Server) -> None:
    aborted = server.metric("neo:request_success_total", finished_reason="abort")
    lengths = server.metric("neo:request_success_total", finished_reason="length")
    # 8 sequences of 1,900 tokens with 20 logprobs each: some 15 MB of events, more than the
    # socket buffers between the server and a client that reads nothing hold.
    flood = {
        "prompt": "flood",
        "max_tokens": 1900,
        "n": 8,
        "logprobs": 20,
        "stream": True,
        "ignore_eos": True,
    }
    body = json.dumps({"model": MODEL, **flood}).encode()
    head = f"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: {len(body)}\r\n\r\n".encode()
    with connect(server, rcvbuf=4096) as sock:
        sock.sendall(head + body)  # and never read
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            if server.metric("neo:request_success_total", finished_reason="abort") > aborted:
                break
            time.sleep(0.2)
        assert (
            server.metric("neo:request_success_total", finished_reason="abort") == aborted + 8
        )  # per sequence
        assert server.metric("neo:request_success_total", finished_reason="length") == lengths
        assert server.metric("neo:num_requests_running") == 0


@pytest.mark.parametrize(
    ("body", "named"),
    [
        ({"prompt": "x", "stop": [f"s{i}" for i in range(10_000)]}, "MAX_STOP_STRINGS"),
        ({"prompt": "x", "stop": ["s" * 5000]}, "MAX_STOP_CHARS"),
        ({"prompt": "x", "stop_token_ids": list(range(5000))}, "MAX_STOP_TOKEN_IDS"),
        ({"prompt": [7] * 200_000}, "context"),  # about 1 MB of token ids
        ({"prompt": "x", "n": 9}, "max_num_seqs"),
        ({"prompt": "x", "max_tokens": 10**6}, "context"),
    ],
    ids=["stop-strings", "stop-length", "stop-ids", "prompt-1mb", "n", "max-tokens"],
)
def test_limits_are_400s_that_name_them(server: Server, body: dict, named: str) -> None:
    r = post(server, body)
    assert r.status_code == 400, r.text
    assert named in r.json()["error"]["message"]
    assert MAX_STOP_STRINGS < 10_000


@pytest.mark.parametrize("flags", [["--request-timeout", "0"], ["--max-connections", "0"]])
def test_bad_limit_flags_are_refused(flags: list[str]) -> None:
    with pytest.raises(SystemExit) as exit_:
        parse_args(flags)
    assert exit_.value.code == 2
