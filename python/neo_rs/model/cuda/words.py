"""16-bit floats as the model's Triton kernels read them: bfloat16 as raw 16-bit words (Triton's
CPU interpreter, where CI runs the kernels, has no bfloat16), widened to float32 in the kernel by
a shift."""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def widen(x, IS_BF16: tl.constexpr):
    if IS_BF16:
        return (x.to(tl.uint16).to(tl.uint32) << 16).to(tl.float32, bitcast=True)
    return x.to(tl.float32)


def as_words(t: torch.Tensor) -> torch.Tensor:
    """``t`` as a kernel takes it: bfloat16 viewed as int16 words, other dtypes as they are."""
    return t.view(torch.int16) if t.dtype == torch.bfloat16 else t
