"""Accuracy of the int8 host pool: teacher-forced over a fixed text (the first 2,176 tokens of the
running CPython's LICENSE.txt, cut into a few sequences run side by side), every decode's
attention on the CPU (``offload="all"``), ``cpu_kv_dtype="int8"`` against ``"auto"``. Prints
perplexity of both, greedy top-1 agreement (also counting exact ties of auto's logits as
agreement) and the mean KL divergence of int8's next-token distribution from auto's. With
bfloat16 on a CPU with AVX512_BF16 it also prints the floor of those figures: auto against auto
with the kernel's bf16 dot products off, two runs that differ only in f32 accumulation order.

Teacher forcing goes through the engine itself: the sampler is wrapped so that each sequence's
next token is the text's, and each step's log-probabilities are recorded.

With ``--weights [int8|int4|fp8|gguf]`` the same measure compares quantized weights
(``--quantization``) with the model dtype's, the host KV as auto in both (targets: perplexity <=
1.01x for int8 and fp8, <= 1.05x for int4; gguf: a GGUF's own 4-bit blocks kept, against the
same file dequantized). Every other run loads the weights in the model dtype (``--quantization
none``). With ``--compiled`` it compares the compiled decoder stack with the same model op by op
(``enforce_eager``), every decode on the device (``offload="none"``), where the stack runs. With
``--row-gemv`` it compares the Rust kernel for a few rows (``model/packed.py``) with oneDNN's GEMM
at every row count (``NEO_RS_ROW_GEMV=0``), the text as one sequence (every decode one row). With
``--cpu-gemm`` it compares the packed linears computing in f32 (``NEO_RS_CPU_GEMM=float32``) with
bf16, the compiled stack in both (offload none).

    python benches/kv_quant.py [--model smollm2-135m-instruct] [--dtype bfloat16] [--seqs 4]
        [--weights [int8|int4|fp8|gguf] | --compiled | --row-gemv | --cpu-gemm]
"""

from __future__ import annotations

import argparse
import math
import os
import sysconfig
import time
from pathlib import Path

import neo_rs.engine.llm_engine
import torch
from neo_rs import LLM, CpuAttention, SamplingParams
from neo_rs.sample.sampling import SampleResult, SampleRow

TEXT = Path(sysconfig.get_paths()["stdlib"]) / "LICENSE.txt"
NUM_TOKENS, PROMPT_TOKENS = 2176, 32


def teacher_forced(
    model: str,
    dtype: str,
    kv: str,
    seqs: list[list[int]],
    quantization: str = "none",
    offload: str = "all",
    enforce_eager: bool | None = None,
) -> tuple[torch.Tensor, float]:
    """Log-probabilities ``[positions, vocab]`` (float16, in a fixed order) of every forced
    position, and the seconds the run took."""
    llm = LLM(
        model,
        dtype=dtype,
        offload=offload,
        cpu_kv_dtype=kv,
        max_num_seqs=len(seqs),
        quantization=quantization,
        enforce_eager=enforce_eager,
    )
    text = {tuple(s[:PROMPT_TOKENS]): s for s in seqs}
    recorded: dict[tuple[int, int], torch.Tensor] = {}
    real = neo_rs.engine.llm_engine.sample

    def forced(
        logits: torch.Tensor, rows: list[SampleRow], generator: torch.Generator, mask: object = None
    ) -> SampleResult:
        logprobs = logits.float().log_softmax(-1)
        tokens = []
        for i, r in enumerate(rows):
            full = text[tuple(r.prompt_ids[:PROMPT_TOKENS])]
            pos = len(r.prompt_ids) + len(r.output_ids)
            recorded[(seqs.index(full), pos)] = logprobs[i].half()
            tokens.append(full[pos])
        return SampleResult(tokens, [None] * len(rows))

    neo_rs.engine.llm_engine.sample = forced  # type: ignore[assignment]
    try:
        start = time.perf_counter()
        params = [SamplingParams(max_tokens=len(s) - PROMPT_TOKENS, ignore_eos=True) for s in seqs]
        llm.generate([s[:PROMPT_TOKENS] for s in seqs], params, use_tqdm=False)
        elapsed = time.perf_counter() - start
    finally:
        neo_rs.engine.llm_engine.sample = real
        llm.shutdown()
    return torch.stack([recorded[k] for k in sorted(recorded)]), elapsed


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--seqs", type=int, help="sequences the text is cut into (default 4; --row-gemv: 1)")
    ap.add_argument(
        "--weights",
        nargs="?",
        const="int8",
        choices=["int8", "int4", "fp8", "gguf"],
        help="quantized weights (--quantization, default int8) against the model dtype's",
    )
    ap.add_argument("--compiled", action="store_true", help="the compiled decoder stack against eager")
    ap.add_argument("--row-gemv", action="store_true", help="the Rust kernel for a few rows against oneDNN")
    ap.add_argument("--cpu-gemm", action="store_true", help="the linears computing in f32 against bf16")
    args = ap.parse_args()
    args.seqs = args.seqs or (1 if args.row_gemv else 4)
    llm = LLM(args.model, dtype=args.dtype)
    ids = llm.get_tokenizer()(TEXT.read_text())["input_ids"][:NUM_TOKENS]
    llm.shutdown()
    per = len(ids) // args.seqs
    seqs = [ids[i * per : (i + 1) * per] for i in range(args.seqs)]
    targets = torch.tensor([t for s in seqs for t in s[PROMPT_TOKENS:]])
    print(f"{args.model} ({args.dtype}): {len(targets)} teacher-forced tokens in {args.seqs} sequences")
    name, target = args.weights or "int8", 1.05 if args.weights == "int4" else 1.01
    if args.compiled:
        name = "compiled"
        print("auto: the same model op by op; both decode on the device (offload none)")
        runs = {
            kv: teacher_forced(args.model, args.dtype, "auto", seqs, offload="none", enforce_eager=eager)
            for kv, eager in (("auto", True), (name, False))
        }
    elif args.row_gemv:
        name = "gemv"
        print("auto: the same model with oneDNN's GEMM at every row count (NEO_RS_ROW_GEMV=0)")
        runs = switched("NEO_RS_ROW_GEMV", ("0", "1"), name, args.model, args.dtype, seqs)
    elif args.cpu_gemm:
        name = "f32"
        print("auto: the same model with its packed linears computing in bf16 (NEO_RS_CPU_GEMM)")
        runs = switched("NEO_RS_CPU_GEMM", ("bfloat16", "float32"), name, args.model, args.dtype, seqs)
    elif args.weights:
        runs = {"auto": teacher_forced(args.model, args.dtype, "auto", seqs)}
        print(f"{name}: the decoder's linear weights (--quantization {name}); the host KV as auto")
        runs[name] = teacher_forced(args.model, args.dtype, "auto", seqs, quantization=name)
    else:
        runs = {"auto": teacher_forced(args.model, args.dtype, "auto", seqs)}
        runs[name] = teacher_forced(args.model, args.dtype, "int8", seqs)
    for kv, (lp, secs) in runs.items():
        nll = -lp.float().gather(1, targets[:, None]).mean().item()
        print(f"{kv:>5}: perplexity {math.exp(nll):8.3f}   ({secs:.0f} s)")
    auto, int8 = runs["auto"][0], runs[name][0]
    ppl_ratio, agree, kl = compare(auto, int8, targets)
    print(f"{name} / auto perplexity: {ppl_ratio:.4f}x (target <= {target})")
    print(f"greedy top-1 agreement: {agree:.2%} (target >= 98%)")
    # Low-precision logits tie exactly (a bfloat16 logit of 16-32 has steps of 0.125); where
    # auto's top two tie, its greedy pick is the lower token id, not the model's preference.
    top2 = auto.float().topk(2, -1).values
    ties = (top2[:, 0] == top2[:, 1]).sum().item()
    print(f"  auto's top two tie exactly at {ties} of {len(auto)} positions; counting {name}'s pick as")
    print(f"  agreeing where it ties auto's top logit: {tie_agreement(auto, int8):.2%}")
    print(f"mean KL(auto || {name}): {kl:.2e} nats")
    if args.dtype == "bfloat16" and CpuAttention(num_threads=1).bf16_dot:
        # How far two exact-enough bf16 runs already differ: auto again, with the kernel's bf16
        # dot products off (a different f32 accumulation order, nothing else).
        os.environ["NEO_RS_BF16_DOT"] = "0"
        widened, _ = teacher_forced(args.model, args.dtype, "auto", seqs)
        _, agree, kl = compare(auto, widened, targets)
        print(
            f"floor, auto against auto with NEO_RS_BF16_DOT=0: agreement {agree:.2%}"
            f" ({tie_agreement(auto, widened):.2%} with ties), KL {kl:.2e} nats"
        )


def switched(
    variable: str, values: tuple[str, str], name: str, model: str, dtype: str, seqs: list[list[int]]
) -> dict[str, tuple[torch.Tensor, float]]:
    """Teacher-forced runs on the device pool (offload none) with ``variable`` at its first value
    (``auto``) and its second (``name``); it is left at the first, so the floor runs as auto did."""
    runs = {}
    for kv, value in zip(("auto", name), values, strict=True):
        os.environ[variable] = value
        runs[kv] = teacher_forced(model, dtype, "auto", seqs, offload="none")
    os.environ[variable] = values[0]
    return runs


def compare(ref: torch.Tensor, other: torch.Tensor, targets: torch.Tensor) -> tuple[float, float, float]:
    """``other``'s perplexity over ``ref``'s, greedy top-1 agreement, mean KL(ref || other)."""
    nll = [-lp.float().gather(1, targets[:, None]).mean().item() for lp in (ref, other)]
    agree = (other.argmax(-1) == ref.argmax(-1)).float().mean().item()
    kl = (ref.float().exp() * (ref.float() - other.float())).sum(-1).mean().item()
    return math.exp(nll[1] - nll[0]), agree, kl


def tie_agreement(ref: torch.Tensor, other: torch.Tensor) -> float:
    """Greedy top-1 agreement where ``other``'s pick counts when ``ref`` scores it as high as its
    own pick (an exact tie)."""
    ref = ref.float()
    return (ref.gather(1, other.argmax(-1, keepdim=True))[:, 0] == ref.max(-1).values).float().mean().item()


if __name__ == "__main__":
    main()
