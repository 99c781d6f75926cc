"""The soak (``benches/soak.py``) for two minutes: after a mixed load of streams, whole responses,
clients that hang up, ``n > 1``, structured outputs, tools, shared prefixes and bad requests on a
tiny device pool under ``neo``, the idle server holds no KV block, has as many open file
descriptors as before, and every request that was neither hung up nor bad completed. (The RSS
slope and latency drift are judged by runs of 10 minutes or more: ``python benches/soak.py``.)"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from server_util import free_port

SOAK = Path(__file__).resolve().parents[2] / "benches" / "soak.py"
KINDS = {"stream", "whole", "chat", "hang_up", "n", "json", "tools", "bad"}


def test_two_minutes_of_mixed_load_leave_nothing_behind() -> None:
    cmd = [sys.executable, str(SOAK), "--minutes", "2", "--interval", "5", "--clients", "6"]
    out = subprocess.run([*cmd, "--port", str(free_port())], capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stdout[-4000:] + out.stderr[-4000:]
    report = json.loads(out.stdout[: out.stdout.rindex("}") + 1])
    assert set(report["completed"]) == KINDS, report["completed"]
    assert report["fds"][0] == report["fds"][1]
