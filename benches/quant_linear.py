"""Weight-only int8 (``--quantization int8``) against bf16 on the CPU device, side by side in one
process: each decoder linear of SmolLM2-135M and of Llama-3.2-1B alone (bf16 as the engine runs
it, prepacked for oneDNN, against ``Int8Linear``) at 1 and 64 rows, with the weight bytes each
reads per call and the bandwidth that makes; then decode end to end through ``LLM`` on SmolLM2
(real weights) and on a Llama-3.2-1B-shaped model (random weights, written once to a temporary
directory): one stream (ms per token after the prompt) and 64 streams (tokens/s).

    python benches/quant_linear.py [--threads 2] [--skip-1b] [--tokens 64]
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path

import torch
from common import cpu_line
from neo_rs import LLM, SamplingParams
from neo_rs.model.packed import PackedLinear
from neo_rs.model.quant import Int8Linear
from safetensors.torch import save_file
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


def linear_table(rows_list: list[int]) -> None:
    head = f"{'shape':<14}{'linear':<14}{'rows':>5}{'bf16 ms':>10}{'int8 ms':>10}"
    print(head + f"{'int8/bf16':>11}{'int8 GB/s':>11}")
    for name, shape in SHAPES.items():
        for lin, (k, n) in linears(shape).items():
            dense = nn.Linear(k, n, bias=False).to(torch.bfloat16)
            nn.init.normal_(dense.weight, std=0.02)
            for rows in rows_list:
                x = torch.randn(rows, k).to(torch.bfloat16)
                bf16 = median_ms(PackedLinear(dense, rows), x)
                int8 = median_ms(Int8Linear(dense), x)
                gbs = (k * n + 2 * n) / (int8 / 1e3) / 1e9
                print(
                    f"{name:<14}{lin:<14}{rows:>5}{bf16:>10.3f}{int8:>10.3f}{int8 / bf16:>10.2f}x{gbs:>11.1f}"
                )


def random_llama(root: Path, shape: tuple[int, ...]) -> Path:
    """A Llama checkpoint of ``shape`` with random bf16 weights (tied embeddings, as Llama 3.2)."""
    hidden, inter, heads, kv, d, layers, vocab = shape
    g = torch.Generator().manual_seed(0)

    def w(*s: int) -> torch.Tensor:
        return (torch.randn(*s, generator=g) * 0.02).to(torch.bfloat16)

    tensors = {
        "model.embed_tokens.weight": w(vocab, hidden),
        "model.norm.weight": torch.ones(hidden).bfloat16(),
    }
    for i in range(layers):
        p = f"model.layers.{i}."
        tensors |= {
            p + "input_layernorm.weight": torch.ones(hidden).bfloat16(),
            p + "post_attention_layernorm.weight": torch.ones(hidden).bfloat16(),
            p + "self_attn.q_proj.weight": w(heads * d, hidden),
            p + "self_attn.k_proj.weight": w(kv * d, hidden),
            p + "self_attn.v_proj.weight": w(kv * d, hidden),
            p + "self_attn.o_proj.weight": w(hidden, heads * d),
            p + "mlp.gate_proj.weight": w(inter, hidden),
            p + "mlp.up_proj.weight": w(inter, hidden),
            p + "mlp.down_proj.weight": w(hidden, inter),
        }
    save_file(tensors, root / "model.safetensors", metadata={"format": "pt"})
    cfg = {
        "architectures": ["LlamaForCausalLM"],
        "hidden_size": hidden,
        "intermediate_size": inter,
        "num_attention_heads": heads,
        "num_key_value_heads": kv,
        "head_dim": d,
        "num_hidden_layers": layers,
        "vocab_size": vocab,
        "rms_norm_eps": 1e-5,
        "rope_theta": 500000.0,
        "max_position_embeddings": 4096,
        "tie_word_embeddings": True,
        "torch_dtype": "bfloat16",
    }
    (root / "config.json").write_text(json.dumps(cfg))
    return root


def decode(model: str, quantization: str | None, threads: int, tokens: int) -> tuple[float, float]:
    """One stream's ms per output token after the first, and 64 streams' output tokens/s."""
    llm = LLM(
        model,
        dtype="bfloat16",
        quantization=quantization,
        cpu_threads=threads,
        max_num_seqs=64,
        skip_tokenizer_init=True,
    )
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(100, 30000, (32,), generator=g).tolist() for _ in range(64)]
    short = SamplingParams(temperature=0, max_tokens=2, ignore_eos=True)
    full = SamplingParams(temperature=0, max_tokens=tokens, ignore_eos=True)
    llm.generate(prompts[:2], short, use_tqdm=False)  # warm-up
    t = time.perf_counter()
    llm.generate(prompts[:1], short, use_tqdm=False)
    first = time.perf_counter() - t
    t = time.perf_counter()
    llm.generate(prompts[:1], full, use_tqdm=False)
    one = (time.perf_counter() - t - first) / (tokens - 2) * 1e3
    t = time.perf_counter()
    llm.generate(prompts, full, use_tqdm=False)
    many = len(prompts) * tokens / (time.perf_counter() - t)
    llm.shutdown()
    return one, many


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--skip-1b", action="store_true", help="SmolLM2 only end to end")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    print(f"{cpu_line()}, {args.threads} threads")
    print(f"torch {torch.__version__}")
    linear_table([1, 64])
    models = {"smollm2-135m": "smollm2-135m-instruct"}
    with tempfile.TemporaryDirectory() as tmp:
        if not args.skip_1b:
            models["llama-3.2-1b (random)"] = str(random_llama(Path(tmp), SHAPES["llama-3.2-1b"]))
        print(f"\n{'model':<24}{'':<6}{'1 stream ms/token':>19}{'64 streams tok/s':>18}")
        for name, path in models.items():
            bf16, int8 = (
                decode(path, None, args.threads, args.tokens),
                decode(path, "int8", args.threads, args.tokens),
            )
            print(f"{name:<24}{'bf16':<6}{bf16[0]:>19.1f}{bf16[1]:>18.1f}")
            print(f"{'':<24}{'int8':<6}{int8[0]:>19.1f}{int8[1]:>18.1f}")
            print(f"{'':<24}{'ratio':<6}{bf16[0] / int8[0]:>18.2f}x{int8[1] / bf16[1]:>17.2f}x", flush=True)


if __name__ == "__main__":
    main()
