"""Prompt attention on a CPU device: torch's causal SDPA (its CPU flash attention) per prompt, as
first chunks ran before, against the Rust kernel attending each prompt row as a decode at its own
position over the pool (``attention/metadata.py``'s kernel rows; without dot products, as
``Attention.prompt_attention`` runs them), a call per prompt as the engine makes them. Times are
per layer, both alternating in one process; the ratio is the kernel's time over SDPA's.
SmolLM2's heads (9 query heads, 3 KV heads, head_dim 64), block 16.

    python benches/prefill_attention.py [--threads 2] [--shapes 64x128,4x512,1x1024,1x2048]
        [--dtype bfloat16,float32]
"""

import argparse

import torch
import torch.nn.functional as F
from attn_cpu import timed_pair
from common import cpu_line
from neo_rs import CpuAttention
from neo_rs.kv.pools import page_aligned_empty

HQ, HKV, D, BLOCK = 9, 3, 64, 16


def case(prompts: int, length: int, dtype: torch.dtype):
    """q/k/v rows of ``prompts`` prompts of ``length`` tokens, the pool holding their K/V (blocks
    in order), and each prompt's kernel rows (tables, lengths)."""
    nb = -(-length // BLOCK)
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(prompts * length, h, D, generator=g).to(dtype) for h in (HQ, HKV, HKV))
    both = page_aligned_empty((1, prompts * nb, HKV, 2, BLOCK, D), dtype)  # the engine's layout
    pos = torch.arange(length).repeat(prompts)
    block = torch.arange(prompts).repeat_interleave(length) * nb + pos // BLOCK
    both[0][block, :, 0, pos % BLOCK], both[0][block, :, 1, pos % BLOCK] = k, v
    tables = torch.arange(prompts * nb, dtype=torch.int32).view(prompts, nb)
    lens = torch.arange(1, length + 1, dtype=torch.int32)
    rows = [(tables[p : p + 1].expand(length, -1).contiguous(), lens) for p in range(prompts)]
    return q, k, v, both[:, :, :, 0], both[:, :, :, 1], rows


def attend(q, k, v, p: int, length: int, scale: float) -> torch.Tensor:  # noqa: ANN001
    """Prompt ``p``'s causal SDPA output, ``[length, heads, head_dim]``."""
    s = slice(p * length, (p + 1) * length)
    qh, kh, vh = (t[s].transpose(0, 1)[None] for t in (q, k, v))
    out = F.scaled_dot_product_attention(qh, kh, vh, is_causal=True, scale=scale, enable_gqa=True)
    return out[0].transpose(0, 1)


def compare(
    kernel: CpuAttention, prompts: int, length: int, dtype: torch.dtype, reps: int
) -> tuple[float, float]:
    """Seconds a layer of SDPA and of the kernel rows take on ``prompts`` prompts of ``length``,
    once their outputs are checked against each other."""
    scale = D**-0.5
    q, k, v, kp, vp, rows = case(prompts, length, dtype)
    out = torch.empty_like(q)

    def sdpa() -> None:
        for p in range(prompts):
            attend(q, k, v, p, length, scale)

    def rust() -> None:
        for p, (tables, lens) in enumerate(rows):
            s = slice(p * length, (p + 1) * length)
            kernel.forward(q[s], kp, vp, 0, tables, lens, scale, out[s])

    with torch.inference_mode():
        rust()
        want = torch.cat([attend(q, k, v, p, length, scale) for p in range(prompts)])
        assert torch.allclose(out.float(), want.float(), atol=2e-2), "the kernel rows disagree with SDPA"
        return timed_pair(sdpa, rust, reps)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--shapes", default="64x128,4x512,1x1024,1x2048", help="PROMPTSxLENGTH,...")
    ap.add_argument("--dtype", default="bfloat16,float32")
    ap.add_argument("--reps", type=int, default=7)
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    kernel = CpuAttention(num_threads=a.threads, openmp_team=True, dot_products=False)
    print(cpu_line(), f"threads {a.threads}, simd {kernel.simd}")
    print(f"{'dtype':9} {'prompts x len':>13} {'SDPA ms':>8} {'kernel ms':>9} {'ratio':>6}")
    for dtype in a.dtype.split(","):
        for shape in a.shapes.split(","):
            prompts, length = (int(x) for x in shape.split("x"))
            base, ours = compare(kernel, prompts, length, getattr(torch, dtype), a.reps)
            print(
                f"{dtype:9} {shape:>13} {base * 1e3:8.2f} {ours * 1e3:9.2f} {ours / base:5.2f}x", flush=True
            )


if __name__ == "__main__":
    main()
