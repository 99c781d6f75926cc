"""Start ``python -m neo_rs.serve`` as a subprocess on a free port and wait until it is ready."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import openai


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class Server:
    """``model``: the ``--model`` flag (the random demo model unless told; None: the server's
    default); ``env``: extra environment variables; ``launcher``: what runs ``-m neo_rs.serve``
    (default: this Python)."""

    def __init__(
        self,
        *flags: str,
        model: str | None = "demo",
        env: dict[str, str] | None = None,
        launcher: tuple[str, ...] = (sys.executable,),
    ) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        log_dir = Path(os.environ.get("NEO_RS_CACHE_DIR", "/tmp"))
        log_dir.mkdir(parents=True, exist_ok=True)
        self.log = log_dir / f"serve-{self.port}.log"
        cmd = [
            *launcher,
            "-m",
            "neo_rs.serve",
            "--port",
            str(self.port),
            "--num-gpu-blocks",
            "2048",
            *(["--model", model] if model else []),
            *flags,
        ]
        self.proc = subprocess.Popen(  # noqa: SIM115
            cmd, stdout=open(self.log, "w"), stderr=subprocess.STDOUT, env={**os.environ, **(env or {})}
        )
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited with {self.proc.returncode}:\n{self.log.read_text()}")
            try:
                with urllib.request.urlopen(self.url + "/health", timeout=1) as r:
                    if r.status == 200:
                        return
            except OSError:
                pass
            time.sleep(0.2)
        self.stop()
        raise RuntimeError(f"server did not become ready:\n{self.log.read_text()}")

    def client(self) -> openai.OpenAI:
        """The real openai client, pointed at this server (no retries: tests see every error)."""
        return openai.OpenAI(base_url=self.url + "/v1", api_key="unused", max_retries=0)

    def metric(self, name: str, **labels: str) -> float:
        """The value of one sample from /metrics (0 if absent)."""
        with urllib.request.urlopen(self.url + "/metrics", timeout=5) as r:
            text = r.read().decode()
        for line in text.splitlines():
            if line.startswith(name) and all(f'{k}="{v}"' in line for k, v in labels.items()):
                return float(line.rsplit(" ", 1)[1])
        return 0.0

    def stop(self, sig: int = signal.SIGTERM, timeout: float = 60) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
        return self.proc.wait(timeout)
