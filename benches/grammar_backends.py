"""Why llguidance: it against xgrammar on SmolLM2-135M-Instruct's tokenizer (49,152 tokens), one
thread each. For 31 JSON Schemas (the serving benchmark's and 30 of the tests' random ones) it
times the cold compile, then replays one valid token sequence per schema (a random allowed token
at each step, drawn from llguidance's mask) through both and times every mask. It also counts the
sequences where xgrammar refuses a token that llguidance allowed.

xgrammar is not a dependency of neo_rs: ``pip install xgrammar`` first.

    python benches/grammar_backends.py
"""

from __future__ import annotations

import json
import random
import statistics
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests" / "python"))
sys.path.insert(0, str(Path(__file__).resolve().parent))

MODEL = "smollm2-135m-instruct"


def main() -> None:
    try:
        import xgrammar as xgr
    except ImportError:
        sys.exit("this comparison needs xgrammar: pip install xgrammar")
    import llguidance
    import llguidance.hf
    from neo_rs.engine.tokenizer import load_tokenizer
    from neo_rs.model.registry import resolve_model
    from neo_rs.sample.structured import JSON_OPTIONS
    from structured import SCHEMA
    from test_structured import random_schema

    hf = load_tokenizer(resolve_model(MODEL, "bfloat16"))
    vocab = len(hf)
    t = time.perf_counter()
    ll_tok = llguidance.hf.from_tokenizer(hf, n_vocab=vocab)
    ll_setup = time.perf_counter() - t
    t = time.perf_counter()
    compiler = xgr.GrammarCompiler(xgr.TokenizerInfo.from_huggingface(hf, vocab_size=vocab), max_threads=1)
    xg_setup = time.perf_counter() - t
    executor = llguidance.LLExecutor(num_threads=1)
    times: dict[str, list[float]] = {"ll_compile": [], "xg_compile": [], "ll_mask": [], "xg_mask": []}
    rng, refused = random.Random(0), 0
    schemas = [SCHEMA] + [random_schema(random.Random(s)) for s in range(30)]
    for schema in schemas:
        t = time.perf_counter()
        source = llguidance.LLMatcher.grammar_from_json_schema(schema, defaults=JSON_OPTIONS)
        ll = llguidance.LLMatcher(ll_tok, source, log_level=0)
        times["ll_compile"].append(time.perf_counter() - t)
        t = time.perf_counter()
        compiled = compiler.compile_json_schema(
            json.dumps(schema), any_whitespace=False, separators=(", ", ": "), strict_mode=True
        )
        times["xg_compile"].append(time.perf_counter() - t)
        xg = xgr.GrammarMatcher(compiled)
        ll_mask = np.empty((1, (vocab + 31) // 32), np.int32)
        xg_mask = xgr.allocate_token_bitmask(1, vocab)
        while not ll.is_stopped():
            t = time.perf_counter()
            executor.unsafe_compute_mask_ptr([(ll, 0)], ll_mask.ctypes.data, ll_mask.shape[1] * 4, 1)
            times["ll_mask"].append(time.perf_counter() - t)
            t = time.perf_counter()
            xg.fill_next_token_bitmask(xg_mask)
            times["xg_mask"].append(time.perf_counter() - t)
            allowed = np.flatnonzero(np.unpackbits(ll_mask.view(np.uint8), bitorder="little"))
            token = int(rng.choice(list(allowed)))
            if token == hf.eos_token_id:
                break
            ll.consume_token(token)
            if not xg.accept_token(token):
                refused += 1
                break
    print(f"tokenizer set-up: llguidance {ll_setup * 1e3:.0f} ms, xgrammar {xg_setup * 1e3:.0f} ms")
    print(f"{'ms':<14} {'llguidance p50':>15} {'p99':>8} {'xgrammar p50':>13} {'p99':>8} {'n':>6}")
    for what in ("compile", "mask"):
        a, b = times["ll_" + what], times["xg_" + what]
        print(
            f"{what:<14} {statistics.median(a) * 1e3:>15.3f} {np.percentile(a, 99) * 1e3:>8.3f} "
            f"{statistics.median(b) * 1e3:>13.3f} {np.percentile(b, 99) * 1e3:>8.3f} {len(a):>6}"
        )
    print(f"sequences where xgrammar refused a token llguidance allowed: {refused} of {len(schemas)}")


if __name__ == "__main__":
    main()
