"""Offload modes side by side: throughput of ``--offload neo``, ``none`` and ``all`` on the
~20M-parameter random Llama with the device KV pool cut so that ``none`` must queue (or swap),
the mix of iteration modes ``neo`` chose, and how many decodes ran on the CPU; ``neo`` and
``all`` run again with the host pool in int8 (``--cpu-kv-dtype int8``).

On this CPU-only machine the "device" is the CPU too, so CPU attention competes with the model
for the same cores: these figures check the machinery, they say little about gains on a GPU
(see ``benches/gpu_check.sh`` for that).

    python benches/offload.py [--prompts 64] [--max-tokens 128] [--gpu-blocks 192]
"""

from __future__ import annotations

import argparse
import collections
import tempfile
import time
from pathlib import Path

from common import make_model, prompts, warm_up_and_queue
from neo_rs import LLMEngine
from neo_rs.config import EngineArgs


def run(
    path: Path, mode: str, kv: str, batch: list[list[int]], args: argparse.Namespace
) -> dict[str, object]:
    engine = LLMEngine(
        EngineArgs(
            model=str(path),
            dtype=args.dtype,
            offload=mode,
            cpu_kv_dtype=kv,
            max_num_seqs=len(batch),
            num_gpu_blocks=args.gpu_blocks,
            num_cpu_blocks=args.cpu_blocks,
            skip_tokenizer_init=True,
        )
    )
    warm_up_and_queue(engine, batch, args.max_tokens)
    modes: collections.Counter[str] = collections.Counter()
    tokens = cpu_decodes = 0
    t = time.perf_counter()
    while engine.has_unfinished():
        tokens += sum(len(o.outputs[0].token_ids) for o in engine.step() if o.finished)
        assert engine.last_stats is not None
        modes[engine.last_stats.mode] += 1
        cpu_decodes += engine.last_stats.num_cpu_decodes
    elapsed = time.perf_counter() - t
    st = engine.scheduler.stats()
    return {
        "tok_s": tokens / elapsed,
        "steps": sum(modes.values()),
        "modes": modes,
        "swaps": st["num_swapped_out"] + st["num_swapped_in"],
        "to_host": st["num_prefills_to_host"],
        "cpu_decodes": cpu_decodes,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--prompts", type=int, default=64)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--gpu-blocks", type=int, default=192, help="device pool (16-token blocks)")
    ap.add_argument("--cpu-blocks", type=int, default=4096)
    ap.add_argument("--dtype", default="bfloat16")
    args = ap.parse_args()
    batch = prompts(args.prompts, 64, 192)
    need = sum(-(-(len(p) + args.max_tokens) // 16) for p in batch)
    print(
        f"{args.prompts} prompts x {args.max_tokens} tokens, {args.dtype}; "
        f"KV need {need} blocks, device {args.gpu_blocks}"
    )
    with tempfile.TemporaryDirectory() as tmp:
        path = make_model(Path(tmp))
        runs = [("none", "auto"), ("neo", "auto"), ("all", "auto"), ("neo", "int8"), ("all", "int8")]
        results = {f"{m} {kv}": run(path, m, kv, batch, args) for m, kv in runs}
    base = results["none auto"]["tok_s"]
    print(
        f"{'mode':<10}{'tok/s':>9}{'vs none':>9}{'steps':>7}{'swaps':>7}{'to host':>9}{'CPU decodes':>13}"
        "  iteration modes"
    )
    for name, r in results.items():
        mix = ", ".join(f"{k} {v}" for k, v in sorted(r["modes"].items()))  # type: ignore[attr-defined]
        print(
            f"{name:<10}{r['tok_s']:>9.1f}{r['tok_s'] / base:>8.2f}x"
            f"{r['steps']:>7}{r['swaps']:>7}{r['to_host']:>9}{r['cpu_decodes']:>13}  {mix}"
        )


if __name__ == "__main__":
    main()
