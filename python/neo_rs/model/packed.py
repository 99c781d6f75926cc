"""bf16 linears on a CPU device, two kernels by row count.

- Batches: oneDNN on a weight reordered once at load into its blocked layout. A bf16
  ``F.linear`` on the CPU reorders the weight on every call; reordering once gives the same
  output, bit for bit, in less time: 1.1-1.4x per GEMM for SmolLM2's shapes at 64 rows
  (``NEO_RS_PACK_LINEARS=0`` turns packing off for the comparison).
- A few rows (``gemv_rows``: single streams' decodes, and their verifying steps under
  speculation): the Rust kernel ``Bf16Linear`` on the plain weight. Such a call reads the whole
  weight for one multiply-add per weight, so it runs at the memory's bandwidth, and oneDNN's
  set-up per call (about 20 us) is a third of a 576-wide layer's; ``benches/gemv.py`` times both.
  The plain weight then stays beside the packed one (one more copy of the linears' weights in
  RAM; ``NEO_RS_ROW_GEMV=0`` drops it).

Where oneDNN's bf16 GEMM runs slower than its f32 one, the batches compute in f32 instead, on a
widened copy of the weight (``gemm_compute``): on an Intel Xeon whose VM hides AMX (family 6
model 207, AVX512-BF16 without AMX) a 64-row step's linears ran 1.48x faster so
(``benches/cpu_gemm.py``). bf16 widens to f32 exactly and oneDNN's bf16 GEMM sums in f32 too, so
only the order of the sums changes. Calls of a few rows stay on the Rust kernel and the bf16
weight, where reading half the bytes is what counts. Where oneDNN has no bf16 GEMM of its own
(x86 with AVX2 but not AVX512-BF16, Arm without BF16), torch's bf16 linear widens as it goes:
SmolLM2's linears at 16 and 64 rows ran 3.3-6.0x slower so than oneDNN's packed f32 GEMM, with
oneDNN, torch and MKL held to AVX2 on the Xeon above. There the batches compute in f32 whenever
the copies fit.

A tied LM head is packed too, a copy of the embedding (57 MB for SmolLM2): unpacked, oneDNN
reorders its 28M weights on every call, 6.9 ms of a 16-stream step's 36. Its Rust kernel reads the
embedding itself.

Under ``torch.compile`` (``worker/compiled.py``) the packed weight cannot enter the graph: an
opaque oneDNN tensor has no fake counterpart to trace with. So the graph reaches the linear
through the op ``neo_rs::packed_linear`` (``graph_ops.GraphLinear``).

Weight-only int8 and int4 linears that run our Rust kernel (``quant``) are told the threads
here too."""

from __future__ import annotations

import functools
import math
import os
import time

import torch
from torch import nn

from neo_rs._core import Bf16Linear
from neo_rs.environment import cpu_gemm
from neo_rs.model.graph_ops import GraphLinear
from neo_rs.model.moe import SparseMoe
from neo_rs.model.quant import GroupedInt8Linear, Int4Linear, Int8Linear

# Rows up to which the Rust kernel beats oneDNN's packed GEMM (``benches/gemv.py``, Zen 5, weights
# read from memory): while the rows' inputs take at most 16 KiB, as the kernel reads them all once
# per weight row (SmolLM2's linears, 576 wide, up to 8 rows at 1.1-1.4x oneDNN's speed; Llama-3.2-
# 1B's, 2,048 wide, up to 4 at 1.0-1.2x, 0.9x at 5; its 8,192-wide down projection at one row), and
# never past the 8 rows one pass of the kernel takes. Not measured where oneDNN has AMX.
GEMV_ROWS = 8
_GEMV_INPUT_VALUES = 8192


def gemv_rows(in_features: int) -> int:
    """How many rows of a linear ``in_features`` wide the Rust kernel takes (one at least)."""
    return max(1, min(GEMV_ROWS, _GEMV_INPUT_VALUES // in_features))


# oneDNN packs for one row in a layout of its own that every other row count runs slower in
# (``benches/pack_rows.py`` on Zen 5, against a pack for two rows: 1.3-1.5x the time at 5 rows,
# 1.1-1.2x at 64, 1.04x at 512, level at one row), while packs for 2 to 256 rows run within 10% of
# each other at any count. An engine of one sequence ran its prefill chunks and verifying steps
# in that layout.
_PACK_ROWS_MIN = 2


def packing_applies(device: torch.device, dtype: torch.dtype) -> bool:
    """bf16 on a CPU with oneDNN, unless turned off (``gemm_compute`` says in what)."""
    return (
        device.type == "cpu"
        and dtype == torch.bfloat16
        and os.environ.get("NEO_RS_PACK_LINEARS", "1") != "0"
        and torch.backends.mkldnn.is_available()
    )


@functools.cache
def bf16_native() -> bool:
    """oneDNN has bf16 GEMMs of its own on this CPU (AVX512-BF16, AMX, Arm's BF16)."""
    return bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())


# ``auto`` computes in f32 where a GEMM timed at load runs at least this much faster so: a clear
# margin, so that timing noise does not flip the choice (and with it the order of the sums) between
# starts. The probe read 1.5-1.67x on the Xeon above; it has not run where bf16 has full-rate dot
# products (AMX, Zen 4 and 5), which it is there to leave on bf16.
_FLOAT32_MARGIN = 1.2
# ... and where the f32 copies, twice the bf16 weights, take at most this share of the free memory.
_FLOAT32_MEMORY_SHARE = 0.5


def gemm_compute(weight_bytes: int) -> torch.dtype | None:
    """What the packed linears of ``weight_bytes`` bf16 bytes compute in (``environment.cpu_gemm``);
    None where neither pays: oneDNN has no bf16 GEMM of its own and the f32 copies do not fit."""
    choice = cpu_gemm()
    if choice != "auto":
        return getattr(torch, choice)
    # Free pages (page cache not counted); where the OS does not say, nothing is taken to fit.
    known = "SC_AVPHYS_PAGES" in os.sysconf_names
    free = os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE") if known else 0
    fits = 2 * weight_bytes <= _FLOAT32_MEMORY_SHARE * free
    if not bf16_native():
        return torch.float32 if fits else None
    pays = fits and float32_speedup(torch.get_num_threads()) >= _FLOAT32_MARGIN
    return torch.float32 if pays else torch.bfloat16


@functools.cache
def float32_speedup(threads: int) -> float:
    """How much faster oneDNN's packed f32 GEMM runs than its bf16 one on torch's ``threads``
    threads: 64 rows of a 1,024-wide linear with 2,048 outputs, the input widened and the output
    narrowed, the best of six alternating calls of each (about 40 ms in all)."""
    gen = torch.Generator().manual_seed(0)
    w = torch.randn(2048, 1024, generator=gen).to(torch.bfloat16)
    x = torch.randn(64, 1024, generator=gen).to(torch.bfloat16)
    best = {dtype: math.inf for dtype in (torch.bfloat16, torch.float32)}
    packs = {dtype: _pack(w, None, 64, dtype) for dtype in best}
    for _ in range(6):
        for dtype, (packed, _) in packs.items():
            start = time.perf_counter()
            _gemm(x, packed, None, dtype)
            best[dtype] = min(best[dtype], time.perf_counter() - start)
    return best[torch.bfloat16] / best[torch.float32]


def _pack(
    weight: torch.Tensor, bias: torch.Tensor | None, rows: int, compute: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The weight reordered by oneDNN for ``rows`` rows, and the bias, both in ``compute``."""
    packed = torch.ops.mkldnn._reorder_linear_weight(weight.to(compute), max(rows, _PACK_ROWS_MIN))
    return packed, None if bias is None else bias.detach().to(compute)


def _gemm(
    x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None, compute: torch.dtype
) -> torch.Tensor:
    if x.dtype == compute:  # bf16 packs, and a graph's f32 rows: no cast calls on the layers' path
        return torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")
    return torch.ops.mkldnn._linear_pointwise(x.to(compute), packed, bias, "none", [], "").to(x.dtype)


class PackedLinear(GraphLinear, nn.Module):
    """An ``nn.Linear`` whose weight oneDNN has reordered (the layout depends on ``rows``, the
    usual number of rows; any number is computed exactly) in ``compute`` (bf16, or a widened f32
    copy), and with ``gemv_threads``, whose calls of up to ``gemv_rows(in_features)`` rows run the
    Rust kernel on that many threads."""

    def __init__(
        self,
        linear: nn.Linear,
        rows: int,
        *,
        gemv_threads: int | None = None,
        compute: torch.dtype = torch.bfloat16,
    ) -> None:
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.compute = compute
        weight = linear.weight.detach()
        # Plain attributes: an opaque oneDNN tensor and a Rust object, never moved or saved.
        self.packed, self.packed_bias = _pack(weight, linear.bias, rows, compute)
        self.gemv = (
            None if gemv_threads is None else Bf16Linear(weight, linear.bias, num_threads=gemv_threads)
        )
        self.weight = linear.weight if self.gemv is not None else None  # what the Rust kernel reads
        self.bias = linear.bias
        self.gemv_numel = gemv_rows(self.in_features) * self.in_features if self.gemv is not None else 0

    def linear(self, x: torch.Tensor) -> torch.Tensor:
        if 0 < x.numel() <= self.gemv_numel:
            return self.rows_kernel(x)
        return _gemm(x, self.packed, self.packed_bias, self.compute)

    def graph_dtype(self, x: torch.Tensor) -> torch.dtype:
        # The one-row graph (``worker/compiled.py``) runs the Rust kernel on bf16 rows. In the other,
        # of two rows or more, Dynamo knows this to be false without a guard on the row count.
        one_row = x.numel() == self.in_features and self.gemv_numel > 0
        return x.dtype if one_row else self.compute

    def rows_kernel(self, x: torch.Tensor) -> torch.Tensor:
        """The Rust kernel's output for ``x`` (any number of rows; ``linear`` sends it a few)."""
        assert self.gemv is not None, "built without gemv_threads"
        if x.dtype != torch.bfloat16:  # a graph's f32 input of a few rows (``graph_dtype``)
            return self.rows_kernel(x.to(torch.bfloat16)).to(x.dtype)
        if x.dim() != 2:  # the decoder's are: its rows are tokens
            return self.rows_kernel(x.reshape(-1, self.in_features)).view(*x.shape[:-1], self.out_features)
        out = x.new_empty(x.shape[0], self.out_features)
        self.gemv.forward(x.contiguous(), out)
        return out


def pack_linears(model: nn.Module, rows: int, gemv_threads: int | None = None) -> tuple[int, torch.dtype]:
    """Replace each linear (a tied LM head too), and pack each MoE layer's experts; returns how
    many linears were packed, and what the linears compute in (``gemm_compute``; the experts, read
    a few rows at a time, stay in bf16). With ``gemv_threads`` (``gemv_applies``), the linears also
    run the Rust kernel for a few rows; the experts do not (their plain weights, most of such a
    model, would stay in RAM twice). Int8 and int4 linears that run our kernel run it on those
    threads."""
    linears = [m for m in model.modules() if isinstance(m, nn.Linear)]
    compute = gemm_compute(sum(m.weight.numel() * m.weight.element_size() for m in linears))
    if compute is None:
        return 0, torch.bfloat16
    count = 0
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if isinstance(child, nn.Linear):
                setattr(parent, name, PackedLinear(child, rows, gemv_threads=gemv_threads, compute=compute))
                count += 1
            elif (
                isinstance(child, Int8Linear | Int4Linear | GroupedInt8Linear)
                and child.gemm is not None
                and gemv_threads
            ):
                child.use_threads(gemv_threads)
        if isinstance(parent, SparseMoe):
            parent.pack(PackedLinear, rows)
            count += 2 * parent.num_experts
    return count, compute
