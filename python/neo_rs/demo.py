"""``python -m neo_rs.demo [PROMPT ...]``: generate with the built-in demo model
(``model/demo.py``, random weights) through the engine, as a first run needs no download."""

from __future__ import annotations

import argparse
import logging
import time

from neo_rs.engine.llm import LLM
from neo_rs.sample.sampling import SamplingParams


def main() -> None:
    """``python -m neo_rs.demo [PROMPT ...]``: generate with the demo model through the engine."""
    ap = argparse.ArgumentParser(description="Generate with the built-in demo model (random weights).")
    ap.add_argument("prompts", nargs="*", default=["Hello, NEO!", "The quick brown fox", "Paged attention"])
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--temperature", type=float, default=0.8)
    args = ap.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    llm = LLM(None)
    params = SamplingParams(temperature=args.temperature, max_tokens=args.max_tokens, ignore_eos=True)
    t = time.perf_counter()
    outs = llm.generate(args.prompts, params)
    elapsed = time.perf_counter() - t
    for o in outs:
        print(f"{o.prompt!r} -> {o.outputs[0].text!r}")
    n = sum(len(o.outputs[0].token_ids) for o in outs)
    print(
        f"{n} tokens in {elapsed:.2f} s ({n / elapsed:.0f} tokens/s); the weights are random, so is the text"
    )


if __name__ == "__main__":
    main()
