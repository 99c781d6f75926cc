"""Offline throughput: ``LLM.generate`` against Hugging Face ``generate`` on the same batch.

A ~20M-parameter random Llama (vocab 32000, hidden 256, 4 layers, 8 heads / 2 KV heads, FFN 688)
is written to a temporary directory; 64 prompts of 32-256 tokens each generate 128 tokens with
``ignore_eos``, in float32 and bfloat16. Both engines run side by side in this process, so the
ratio is what to read on a noisy machine.

    python benches/offline.py [--prompts 64] [--max-tokens 128] [--dtypes float32,bfloat16]

``--moe``: instead, a random Qwen3-MoE (Qwen3-30B-A3B's shape, narrower) against the same model
made dense with its active parameter count, both on neo_rs: generation time, and one MLP layer's
time at one stream (1 row), a decode batch (64 rows) and a prefill (1024 rows), beside the weight
bytes each must read (a batch touches more experts than one token does: at 64 rows, all of them).
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

import torch
from common import make_model, make_moe_pair, prompts


def run_neo(path: Path, batch: list[list[int]], max_tokens: int, dtype: str) -> float:
    from neo_rs import LLM, SamplingParams

    llm = LLM(str(path), dtype=dtype, max_num_seqs=len(batch), skip_tokenizer_init=True)
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    llm.generate(
        batch[:2], SamplingParams(temperature=0, max_tokens=4, ignore_eos=True), use_tqdm=False
    )  # warm-up
    t = time.perf_counter()
    outs = llm.generate(batch, params, use_tqdm=False)
    elapsed = time.perf_counter() - t
    assert all(len(o.outputs[0].token_ids) == max_tokens for o in outs)
    return len(batch) * max_tokens / elapsed


def run_hf(path: Path, batch: list[list[int]], max_tokens: int, dtype: str) -> float:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=getattr(torch, dtype)).eval()
    width = max(len(p) for p in batch)
    ids = torch.zeros(len(batch), width, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, p in enumerate(batch):  # left padding
        ids[i, width - len(p) :] = torch.tensor(p)
        mask[i, width - len(p) :] = 1
    kw = dict(do_sample=False, eos_token_id=None, pad_token_id=0)
    with torch.inference_mode():
        model.generate(ids[:2], attention_mask=mask[:2], max_new_tokens=4, **kw)  # warm-up
        t = time.perf_counter()
        out = model.generate(
            ids, attention_mask=mask, max_new_tokens=max_tokens, min_new_tokens=max_tokens, **kw
        )
        elapsed = time.perf_counter() - t
    assert out.shape[1] == width + max_tokens
    return len(batch) * max_tokens / elapsed


def median_ms(fn, x: torch.Tensor) -> float:  # noqa: ANN001 (a module)
    times = []
    with torch.inference_mode():
        for _ in range(23):
            t = time.perf_counter()
            fn(x)
            times.append(time.perf_counter() - t)
    return sorted(times[3:])[len(times[3:]) // 2] * 1e3


def mlp_ms(path: Path, dtype: str, rows: int) -> float:
    """One decoder layer's MLP (dense or sparse) over ``rows`` random hidden states, as the
    engine built it (prepacked on the CPU in bf16), median of 20."""
    from neo_rs import LLM

    llm = LLM(str(path), dtype=dtype, skip_tokenizer_init=True, num_gpu_blocks=64)
    model = llm.engine.runner.model
    ms = median_ms(
        model.decoder_layers[0].mlp, torch.randn(rows, model.config.hidden_size, dtype=getattr(torch, dtype))
    )
    llm.engine.shutdown()
    return ms


def full_width_ms(dtype: str, rows: int) -> tuple[float, float]:
    """Qwen3-30B-A3B's MoE layer itself (hidden 2048, 128 experts of 768, 8 per token) against a
    dense MLP of its active width (8 x 768), random weights, prepacked as the engine does."""
    from neo_rs.config import MoeConfig
    from neo_rs.model.decoder import DenseMlp
    from neo_rs.model.moe import SparseMoe
    from neo_rs.model.packed import pack_linears, packing_applies
    from neo_rs.parallel.group import SINGLE_PROCESS

    dt = getattr(torch, dtype)
    moe = SparseMoe(2048, MoeConfig(128, 8, 768, True, (True,)), SINGLE_PROCESS).to(dt)
    dense = DenseMlp(2048, 8 * 768, SINGLE_PROCESS).to(dt)
    for module in (moe, dense):
        for p in module.parameters():
            torch.nn.init.normal_(p, std=0.02)
        if packing_applies(torch.device("cpu"), dt):
            pack_linears(module, 64)
    x = torch.randn(rows, 2048, dtype=dt)
    return median_ms(moe, x), median_ms(dense, x)


def moe_vs_dense(args: argparse.Namespace, batch: list[list[int]]) -> None:
    experts, top_k = 32, 4  # make_moe_pair's
    header = f"{'dtype':<10}{'what':<30}{'MoE':>10}{'dense':>10}{'time MoE/dense':>16}{'bytes MoE/dense':>17}"

    def row(dtype: str, what: str, m: float, d: float, bytes_ratio: float | None = None) -> None:
        line = f"{dtype:<10}{what:<30}{m:>10.2f}{d:>10.2f}{m / d:>15.2f}x"
        print(line + (f"{bytes_ratio:>16.2f}x" if bytes_ratio is not None else ""), flush=True)

    print("Qwen3-30B-A3B's MoE layer at full width against its dense-active twin:")
    print(header)
    for dtype in args.dtypes.split(","):
        for rows in (1, 64):
            m, d = full_width_ms(dtype, rows)
            row(dtype, f"MLP ms, {rows} rows", m, d, 128 * (1 - (1 - 8 / 128) ** rows) / 8)
    with tempfile.TemporaryDirectory() as tmp:
        moe, dense = make_moe_pair(Path(tmp))
        print("The narrow pair, in the engine:")
        print(header)
        for dtype in args.dtypes.split(","):
            for rows in (1, 64, 1024):
                m, d = mlp_ms(moe, dtype, rows), mlp_ms(dense, dtype, rows)
                touched = experts * (1 - (1 - top_k / experts) ** rows)  # expected, uniform routing
                row(dtype, f"MLP ms, {rows} rows", m, d, touched / top_k)
            m, d = (run_neo(p, batch, args.max_tokens, dtype) for p in (moe, dense))
            row(dtype, "generate s per token (x1000)", 1e3 / m, 1e3 / d)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--prompts", type=int, default=64)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--dtypes", default="float32,bfloat16")
    ap.add_argument("--moe", action="store_true", help="an MoE model against its dense-active twin")
    args = ap.parse_args()
    batch = prompts(args.prompts)
    print(f"{args.prompts} prompts ({sum(map(len, batch))} prompt tokens) x {args.max_tokens} output tokens")
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads")
    if args.moe:
        moe_vs_dense(args, batch)
        return
    with tempfile.TemporaryDirectory() as tmp:
        path = make_model(Path(tmp))
        print(f"{'dtype':<10}{'neo_rs tok/s':>14}{'HF tok/s':>12}{'ratio':>8}")
        for dtype in args.dtypes.split(","):
            neo = run_neo(path, batch, args.max_tokens, dtype)
            hf = run_hf(path, batch, args.max_tokens, dtype)
            print(f"{dtype:<10}{neo:>14.1f}{hf:>12.1f}{neo / hf:>8.2f}x", flush=True)


if __name__ == "__main__":
    main()
