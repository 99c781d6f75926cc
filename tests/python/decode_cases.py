"""Random paged-decode cases shared by the device backends' tests (each against the Rust kernel):
GQA groups (powers of two and not), ragged last blocks, empty, one-token and 8k-token sequences,
with every pool slot past a sequence's length poisoned (never-cleared memory: NaN and inf)."""

from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import contextmanager

import torch

# Where the Triton kernels run in their tests: compiled on the GPU where CUDA is present, else in
# Triton's interpreter on the CPU (CI). Triton decides when it decorates a kernel whether to
# interpret it, and checks again at calls: the test modules set the variable for their imports
# (interpret_imports) and for each test, never on a CUDA host, where every other test in the
# session must get the compiled kernels.
KERNEL_DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
INTERPRET = KERNEL_DEVICE.type == "cpu"


@contextmanager
def interpret_imports() -> Iterator[None]:
    """``TRITON_INTERPRET=1`` for the imports inside, without CUDA only; restored after."""
    was = os.environ.get("TRITON_INTERPRET")
    if INTERPRET:
        os.environ["TRITON_INTERPRET"] = "1"
    try:
        yield
    finally:
        if was is None:
            os.environ.pop("TRITON_INTERPRET", None)


TOL = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 2e-2}


def make_case(
    lens: list[int], kv_heads: int, group: int, head_dim: int, block_size: int, dtype: torch.dtype, seed: int
) -> tuple[torch.Tensor, ...]:
    g = torch.Generator().manual_seed(seed)
    blocks = [max(1, -(-n // block_size)) for n in lens]
    num_blocks = sum(blocks) + 3
    shape = (2, num_blocks, kv_heads, block_size, head_dim)
    k, v = torch.randn(shape, generator=g).to(dtype), torch.randn(shape, generator=g).to(dtype)
    order = torch.randperm(num_blocks, generator=g)
    tables = torch.zeros(len(lens), max(blocks), dtype=torch.int32)
    at = 0
    for i, (n, nb) in enumerate(zip(lens, blocks, strict=True)):
        tables[i, :nb] = order[at : at + nb]
        at += nb
        for pos in range(n, nb * block_size):  # never-cleared pool memory: NaN and inf
            block = int(tables[i, pos // block_size])
            k[:, block, :, pos % block_size] = float("nan")
            v[:, block, :, pos % block_size] = float("inf")
    q = torch.randn(len(lens), kv_heads * group, head_dim, generator=g).to(dtype)
    return q, k, v, tables, torch.tensor(lens, dtype=torch.int32)


CASES = [
    # lens, kv_heads, group, head_dim, block_size
    ([1, 17, 300, 0, 33], 2, 4, 64, 16),
    ([5, 64, 129], 3, 3, 80, 8),
    ([8192], 1, 8, 64, 16),
    ([40, 1, 2], 4, 1, 128, 32),
    ([250, 7], 2, 2, 32, 16),
]

# Attention kinds the backends are held to beyond plain causal attention: (case, window,
# softcap) over CASES, windows shorter than a block, across blocks and cutting a split sequence.
KIND_CASES = [(0, 7, None), (1, 20, 5.0), (2, 1000, None), (3, None, 3.0), (4, 16, 1.0)]


def reference_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    first: int,
    scale: float,
    window: int | None = None,
    softcap: float | None = None,
) -> torch.Tensor:
    """In float64: rows ``q`` ``[rows, heads, d]`` at positions ``first ..`` attending causally
    over ``k``/``v`` ``[keys, kv_heads, d]``, within the last ``window`` positions, the scaled
    scores capped by ``softcap · tanh(s / softcap)``."""
    group = q.shape[1] // k.shape[1]
    kh, vh = (t.double().repeat_interleave(group, 1).transpose(0, 1) for t in (k, v))
    s = torch.matmul(q.double().transpose(0, 1), kh.transpose(-1, -2)) * scale
    if softcap is not None:
        s = softcap * torch.tanh(s / softcap)
    pos_q = torch.arange(first, first + q.shape[0])[:, None]
    pos_k = torch.arange(k.shape[0])[None, :]
    mask = pos_k <= pos_q
    if window is not None:
        mask &= pos_k > pos_q - window
    return torch.matmul(torch.softmax(s.masked_fill(~mask, float("-inf")), dim=-1), vh).transpose(0, 1)
