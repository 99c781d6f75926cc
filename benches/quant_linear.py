"""Weight-only int8, int4 and FP8 (``--quantization int8|int4|fp8``) against bf16 on the CPU device,
side by side in one process: each decoder linear of SmolLM2-135M and of Llama-3.2-1B alone (bf16 as
the engine runs it: prepacked for oneDNN, the Rust kernel for a few rows; against ``Int8Linear``,
``Int4Linear`` and ``Fp8Linear``, the first two our Rust kernel where the CPU has AVX512_BF16 or
AVX2, and with AVX512_BF16 ``GroupedInt8Linear`` in groups of 32 and 16, a GGUF's Q8_0 and Q6_K as
the kernel keeps them; ``benches/quant_kernels.py`` times the kernels alone) at 1 and 64 rows, with
the weight bytes each reads per call and the bandwidth that makes; then decode end to end through
``LLM`` on SmolLM2 (real weights) and on a Llama-3.2-1B-shaped model (random weights, written once
to a temporary directory): one stream (ms per token after the prompt) and 64 streams (tokens/s);
SmolLM2 also with its GGUF's own Q4_1 blocks kept (``gguf``, its default, int4 in groups of 32),
bf16 being that file dequantized. Each method runs beside a bf16 engine loaded with it, in pairs
whose order alternates, and its ratios are the median of the pairs' (this VM's read bandwidth drifts
between minutes). A linear alone may stay in the last-level cache between calls (SmolLM2's all do,
and the 1B shape's smaller ones: rates above the memory's). Last, the roofline of one stream: the
weight bytes a token reads (the LM head stays bf16) over the measured read bandwidth, against the
measured time.

    python benches/quant_linear.py [--threads 2] [--skip-1b] [--tokens 64] [--pairs 3]
        [--methods int8 int4 ...]
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

import torch
from common import cpu_line, random_llama
from neo_rs import LLM, SamplingParams
from neo_rs.model.fp8 import Fp8Linear
from neo_rs.model.packed import PackedLinear
from neo_rs.model.quant import (
    GroupedInt8Linear,
    Int4Linear,
    Int8Blocks,
    Int8Linear,
    grouped_int8_runs,
    int4_group_size,
)
from neo_rs.model.rust_linears import gemv_applies
from torch import nn

# (hidden, intermediate, heads, kv heads, head dim, layers, vocab)
SHAPES = {
    "smollm2-135m": (576, 1536, 9, 3, 64, 30, 49152),
    "llama-3.2-1b": (2048, 8192, 32, 8, 64, 16, 128256),
}


def linears(shape: tuple[int, ...]) -> dict[str, tuple[int, int]]:
    """The engine's fused decoder linears, (in, out)."""
    hidden, inter, heads, kv, d = shape[:5]
    return {
        "qkv_proj": (hidden, (heads + 2 * kv) * d),
        "o_proj": (heads * d, hidden),
        "gate_up_proj": (hidden, 2 * inter),
        "down_proj": (inter, hidden),
    }


def median_ms(fn: nn.Module, x: torch.Tensor, reps: int = 30) -> float:
    with torch.inference_mode():
        for _ in range(3):
            fn(x)
        times = []
        for _ in range(reps):
            t = time.perf_counter()
            fn(x)
            times.append((time.perf_counter() - t) * 1e3)
    return statistics.median(times)


def weight_bytes(module: nn.Module) -> int:
    """Bytes of the weight a linear reads per call: its buffers (quantized) or its weight."""
    tensors = list(module.buffers()) or [module.weight]
    return sum(t.numel() * t.element_size() for t in tensors)


def grouped_int8(dense: nn.Linear, group: int) -> GroupedInt8Linear:
    """``dense`` as a GGUF's Q8_0 (``group`` 32) or Q6_K (16) is kept: int8 by a scale per group."""
    w = dense.weight.detach().float()
    groups = w.reshape(w.shape[0], -1, group)
    scale = groups.abs().amax(dim=-1) / 127
    q = torch.round(groups / scale.clamp_min(1e-30)[..., None]).to(torch.int8).reshape(w.shape)
    return GroupedInt8Linear(dense, Int8Blocks(q, scale, torch.zeros_like(scale)), dense.weight)


def linear_table(rows_list: list[int]) -> None:
    """Each linear's time (ms) in bf16, int8, int4, fp8 and grouped int8 (``g8/32``, ``g8/16``),
    each quantized one's ratio to bf16, and the weight bytes per second each reads (GB/s)."""
    methods = ("int8", "int4", "fp8", "g8/32", "g8/16")
    print(f"{'shape':<14}{'linear':<14}{'rows':>5}" + "".join(f"{h:>10}" for h in ("bf16", *methods)), end="")
    print(
        "".join(f"{m + '/bf16':>11}" for m in methods) + "".join(f"{h:>10}" for h in ("GB/s bf16", *methods))
    )
    gemv = torch.get_num_threads() if gemv_applies() else None  # as the engine runs bf16
    for name, shape in SHAPES.items():
        for lin, (k, n) in linears(shape).items():
            dense = nn.Linear(k, n, bias=False).to(torch.bfloat16)
            nn.init.normal_(dense.weight, std=0.02)
            quantized = Int8Linear(dense), Int4Linear(dense), Fp8Linear(dense)
            if grouped_int8_runs(torch.device("cpu"), torch.bfloat16):  # only our kernel runs grouped int8
                quantized += (grouped_int8(dense, 32), grouped_int8(dense, 16))
            for rows in rows_list:
                x = torch.randn(rows, k).to(torch.bfloat16)
                ms = [
                    median_ms(PackedLinear(dense, rows, gemv_threads=gemv), x),
                    *(median_ms(q, x) for q in quantized),
                ]
                ms += [float("nan")] * (len(methods) + 1 - len(ms))
                nbytes = [weight_bytes(dense), *(weight_bytes(q) for q in quantized)]
                rates = [b / (t / 1e3) / 1e9 for b, t in zip(nbytes, ms, strict=False)]
                print(f"{name:<14}{lin:<14}{rows:>5}" + "".join(f"{t:>10.3f}" for t in ms), end="")
                print("".join(f"{t / ms[0]:>10.2f}x" for t in ms[1:]) + "".join(f"{r:>10.1f}" for r in rates))


def read_gbs() -> float:
    """Memory read bandwidth (GB/s): a sum over 1 GiB of float32, far past the caches."""
    x = torch.ones(1 << 28)
    return x.numel() * 4 / (median_ms(lambda t: t.sum(), x, reps=5) / 1e3) / 1e9


def token_bytes(shape: tuple[int, ...], method: str | None) -> float:
    """Weight bytes one decode step reads: the decoder linears as ``method`` keeps them (int8: a
    bf16 scale per row; int4: a bf16 scale and zero per group of 128, 64 where the width needs;
    gguf: per block of 32), and the LM head in bf16."""
    total = 0.0
    for k, n in linears(shape).values():
        group = int4_group_size(k) or 1  # the shapes here all have one
        per = {None: 2.0, "int8": 1 + 2 / k, "fp8": 1 + 4 / k, "int4": 0.5 + 4 / group, "gguf": 0.5 + 4 / 32}[
            method
        ]
        total += k * n * per
    hidden, vocab, layers = shape[0], shape[6], shape[5]
    return layers * total + vocab * hidden * 2


class Decode:
    """An engine on ``model`` with ``quantization``, and the prompts it decodes."""

    def __init__(self, model: str, quantization: str | None, threads: int, tokens: int) -> None:
        self.llm = LLM(
            model,
            dtype="bfloat16",
            quantization=quantization,
            cpu_threads=threads,
            max_num_seqs=64,
            skip_tokenizer_init=True,
        )
        g = torch.Generator().manual_seed(0)
        self.prompts = [torch.randint(100, 30000, (32,), generator=g).tolist() for _ in range(64)]
        self.short = SamplingParams(temperature=0, max_tokens=2, ignore_eos=True)
        self.full = SamplingParams(temperature=0, max_tokens=tokens, ignore_eos=True)
        self.tokens = tokens
        self.llm.generate(self.prompts[:2], self.short, use_tqdm=False)  # warm-up

    def one_stream(self) -> float:
        """ms per output token after the first."""
        t = time.perf_counter()
        self.llm.generate(self.prompts[:1], self.short, use_tqdm=False)
        first = time.perf_counter() - t
        t = time.perf_counter()
        self.llm.generate(self.prompts[:1], self.full, use_tqdm=False)
        return (time.perf_counter() - t - first) / (self.tokens - 2) * 1e3

    def many_streams(self) -> float:
        """64 streams' output tokens/s."""
        t = time.perf_counter()
        self.llm.generate(self.prompts, self.full, use_tqdm=False)
        return len(self.prompts) * self.tokens / (time.perf_counter() - t)


def paired(
    bf16: Decode, other: Decode, pairs: int
) -> tuple[tuple[float, float], tuple[float, float], float, float]:
    """bf16's and ``other``'s medians (one stream ms/token, 64 streams tok/s) over ``pairs``
    pairs run in alternating order, and the medians of the pairs' ratios (bf16 / other's ms,
    other / bf16's tok/s)."""
    runs: dict[int, list[tuple[float, float]]] = {0: [], 1: []}
    for p in range(pairs):
        order = (bf16, other) if p % 2 == 0 else (other, bf16)
        for engine in order:
            runs[engine is other].append((engine.one_stream(), engine.many_streams()))
    med = {
        i: (statistics.median(r[0] for r in runs[i]), statistics.median(r[1] for r in runs[i])) for i in runs
    }
    one = statistics.median(b[0] / o[0] for b, o in zip(runs[0], runs[1], strict=True))
    many = statistics.median(o[1] / b[1] for b, o in zip(runs[0], runs[1], strict=True))
    return med[0], med[1], one, many


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--pairs", type=int, default=3, help="alternating bf16/method pairs per method")
    ap.add_argument("--skip-1b", action="store_true", help="SmolLM2 only end to end")
    ap.add_argument(
        "--methods",
        nargs="+",
        default=["int8", "int4", "fp8", "gguf"],
        help="end to end (fp8 on the 1B shape: minutes)",
    )
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    print(f"{cpu_line()}, {args.threads} threads")
    print(f"torch {torch.__version__}")
    linear_table([1, 64])
    models = {"smollm2-135m": "smollm2-135m-instruct"}
    with tempfile.TemporaryDirectory() as tmp:
        if not args.skip_1b:
            models["llama-3.2-1b (random)"] = str(random_llama(Path(tmp), SHAPES["llama-3.2-1b"]))
        print(f"\n{'model':<24}{'':<10}{'1 stream ms/token':>19}{'64 streams tok/s':>18}   (median of pairs)")
        one_stream = {}
        for name, path in models.items():
            bf16 = Decode(path, "none", args.threads, args.tokens)  # SmolLM2's GGUF dequantized
            # SmolLM2's file is Q4_1: its own blocks, kept (the default, ``gguf``), against our
            # int4 groups; the random 1B shape has no file of its own.
            for method in [m for m in args.methods if m != "gguf" or path.endswith("instruct")]:
                engine = Decode(path, method, args.threads, args.tokens)
                base, q, one, many = paired(bf16, engine, args.pairs)
                engine.llm.shutdown()
                one_stream[name, None], one_stream[name, method] = base[0], q[0]
                print(f"{name:<24}{'bf16':<10}{base[0]:>19.1f}{base[1]:>18.1f}")
                print(f"{'':<24}{method:<10}{q[0]:>19.1f}{q[1]:>18.1f}")
                print(f"{'':<24}{method + '/bf16':<10}{one:>18.2f}x{many:>17.2f}x", flush=True)
            bf16.llm.shutdown()
    gbs = read_gbs()
    print(f"\nroofline of one stream, memory read {gbs:.1f} GB/s")
    print(f"{'model':<24}{'':<6}{'MB/token':>10}{'floor ms':>10}{'measured':>10}{'/floor':>8}")
    for (name, method), ms in one_stream.items():
        mb = token_bytes(SHAPES[name.split()[0]], method) / 1e6
        floor = mb / 1e3 / gbs * 1e3
        print(f"{name:<24}{method or 'bf16':<6}{mb:>10.0f}{floor:>10.1f}{ms:>10.1f}{ms / floor:>7.2f}x")


if __name__ == "__main__":
    main()
