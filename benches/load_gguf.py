"""Loading the default model (SmolLM2-135M-Instruct GGUF): cold (fetch + convert + load) and warm
(cached) times, and each phase's peak resident memory as a multiple of the loaded weights.

    python benches/load_gguf.py [--dtype bfloat16]

Each phase runs in a fresh interpreter on an empty (cold) or filled (warm) cache directory, so the
peaks are not hidden by an earlier phase's allocations."""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile

PHASE = r"""
import json, os, resource, sys, time
os.environ["NEO_RS_CACHE_DIR"] = sys.argv[1]
import torch, transformers, gguf  # noqa: F401  (imports are not part of the load)
from neo_rs.config import ModelConfig
from neo_rs.model.loader import load_model
from neo_rs.model.registry import DEFAULT_MODEL, resolve_model

def rss_mib():
    return int(open("/proc/self/statm").read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20

base = rss_mib()
start = time.perf_counter()
model_dir = resolve_model(DEFAULT_MODEL, sys.argv[2])
cfg = ModelConfig.from_dir(model_dir)
model = load_model(model_dir, cfg, cfg.torch_dtype, torch.device("cpu"), 2048)
seconds = time.perf_counter() - start
weights = sum(p.numel() * p.element_size() for p in model.parameters()) / 2**20
peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024 - base
print(json.dumps({"seconds": seconds, "weights_mib": weights, "peak_mib": peak}))
"""


def phase(cache: str, dtype: str) -> dict:
    out = subprocess.run(
        [sys.executable, "-c", PHASE, cache, dtype], check=True, capture_output=True, text=True
    ).stdout
    return json.loads(out.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--dtype", default="auto")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as cache:
        cold = phase(cache, args.dtype)
        warm = phase(cache, args.dtype)
    print(f"{'phase':<6} {'seconds':>8} {'weights MiB':>12} {'peak MiB':>9} {'peak/weights':>13}")
    for name, r in (("cold", cold), ("warm", warm)):
        ratio = r["peak_mib"] / r["weights_mib"]
        sizes = f"{r['weights_mib']:>12.0f} {r['peak_mib']:>9.0f}"
        print(f"{name:<6} {r['seconds']:>8.1f} {sizes} {ratio:>13.2f}")


if __name__ == "__main__":
    main()
