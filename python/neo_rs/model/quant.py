"""Weight-only quantized linears, each decoder linear's weight quantized at load and kept so in
memory; activations stay in the model dtype and the weight is read at a fraction of bf16's
bytes, which is what bounds decode at small batches:

- ``--quantization int8``: int8 per output channel (symmetric, ``scale = max|row| / 127``),
  multiplied by torch's ``_weight_int8pack_mm`` (CPU and CUDA kernels);
- ``--quantization int4``: 4 bits per weight in groups of 128 input columns (64 or 32 where the
  input width needs), asymmetric (a scale and a zero per group, round to nearest), multiplied
  by torch's tinygemm kernels (``_weight_int4pack_mm_for_cpu``; on CUDA ``_weight_int4pack_mm``
  from sm_80 in bfloat16, else our Triton kernel, ``cuda/grouped_gemm.py``).

Except on a CPU with AVX512_BF16 or AVX2 (``rust_linears.quant_kernel_applies``): there both are
packed at load for our Rust kernel (``_core.QuantGemm``, ``rust/qlinear/``), which widens each
block of the weight once a call for all rows, where torch's kernels widen it again for every row
(and in float32 or float16 are many times slower than in bf16). The compiled graph reaches it
through ``neo_rs::packed_linear`` (``graph_ops.GraphLinear``). That kernel with AVX512_BF16 in
bf16, and on CUDA our Triton GEMM, also run ``GroupedInt8Linear``: int8 values with a scale and a
zero per group, a GGUF's other block types and 8-bit GPTQ (``Int8Blocks``), which elsewhere (AVX2
alone, a float32 or float16 model: ``grouped_int8_kernel_applies``) are dequantized at load.

The embeddings and the LM head stay unquantized, as vLLM keeps them, and so do an MoE layer's
experts (not yet quantized; the log says so)."""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator
from typing import NamedTuple

import torch
from torch import nn

from neo_rs._core import QuantGemm
from neo_rs.cuda_runtime import runtime
from neo_rs.errors import ModelLoadError
from neo_rs.model.fp8 import Fp8Linear
from neo_rs.model.graph_ops import GraphLinear
from neo_rs.model.moe import SparseMoe
from neo_rs.model.rust_linears import grouped_int8_kernel_applies, quant_kernel_applies

log = logging.getLogger(__name__)


def quantize_int8(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``w`` ``[out, in]`` as int8 rows and their float32 scales (``w ≈ q * scale[:, None]``);
    rounded half to even, an all-zero row gets scale 0."""
    w = w.detach().float()
    scale = w.abs().amax(dim=1) / 127
    q = torch.round(w / scale.clamp_min(torch.finfo(torch.float32).tiny)[:, None]).clamp_(-127, 127)
    return q.to(torch.int8), scale


# Output columns per block of ``QuantGemm``'s layouts (``rust/qlinear``).
QUANT_COLS = 16


def pack_int8(q: torch.Tensor) -> torch.Tensor:
    """``q`` (``[n, k]`` int8) in ``QuantGemm``'s int8 layout, ``[ceil(n / 16), ceil(k / 2), 16,
    2]``: blocks of 16 output columns, and in each, for every pair of inputs, each column's two
    weights; zeros pad ``n`` and ``k``."""
    n, k = q.shape
    blocks, pairs = -(-n // QUANT_COLS), -(-k // 2)
    padded = q.new_zeros(blocks * QUANT_COLS, pairs * 2)
    padded[:n, :k] = q
    return padded.view(blocks, QUANT_COLS, pairs, 2).transpose(1, 2).contiguous()


def pack_int4(q: torch.Tensor) -> torch.Tensor:
    """``q`` (``[n, k]``, 0..15, ``k`` even) in ``QuantGemm``'s int4 layout, uint8 ``[ceil(n /
    16), k / 2, 16]``: as int8's (lane ``2c + i`` of a pair is column ``c``'s input ``2p + i``),
    lane ``j`` in byte ``j``'s low nibble and lane ``16 + j`` in its high one."""
    n, k = q.shape
    blocks = -(-n // QUANT_COLS)
    padded = q.new_zeros(blocks * QUANT_COLS, k, dtype=torch.uint8)
    padded[:n] = q
    lanes = padded.view(blocks, QUANT_COLS, k // 2, 2).transpose(1, 2).reshape(blocks, k // 2, 2 * QUANT_COLS)
    return (lanes[..., :QUANT_COLS] | lanes[..., QUANT_COLS:] << 4).contiguous()


def unpack_int8(packed: torch.Tensor, n: int, k: int) -> torch.Tensor:
    """``pack_int8``'s input back from its output."""
    return packed.transpose(1, 2).reshape(packed.shape[0] * QUANT_COLS, -1)[:n, :k]


def groups_by_block(scales_zeros: torch.Tensor, n: int) -> torch.Tensor:
    """Scales and zeros ``[in / group, n, 2]`` in ``QuantGemm``'s layout, ``[ceil(n / 16), in /
    group, 2, 16]``: per block of 16 columns and group, 16 scales then 16 zeros."""
    groups = scales_zeros.shape[0]
    blocks = -(-n // QUANT_COLS)
    padded = scales_zeros.new_zeros(groups, blocks * QUANT_COLS, 2)
    padded[:, :n] = scales_zeros
    return padded.view(groups, blocks, QUANT_COLS, 2).permute(1, 0, 3, 2).contiguous()


def _run(gemm: QuantGemm, x: torch.Tensor, in_features: int, out_features: int) -> torch.Tensor:
    """``gemm`` over ``x``'s rows (any leading shape)."""
    rows = x.reshape(-1, in_features).contiguous()
    out = rows.new_empty(rows.shape[0], out_features)
    if rows.shape[0]:
        gemm.forward(rows, out)
    return out.view(*x.shape[:-1], out_features)


class Int8Linear(GraphLinear, nn.Module):
    """An ``nn.Linear`` whose weight is int8 with a scale per output row (in the model dtype, as
    the kernels take them); the output is in the input's dtype. The weight is in torch's layout,
    or packed for our kernel where it runs (``gemm``: our kernel's object, else None)."""

    weight: torch.Tensor
    scales: torch.Tensor

    def __init__(self, linear: nn.Linear, home: torch.Tensor | None = None) -> None:
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        like = linear.weight if home is None else home  # see Int4Linear
        q, scale = quantize_int8(linear.weight)
        ours = quant_kernel_applies(like.device, like.dtype)
        self.register_buffer("weight", pack_int8(q) if ours else q.to(like.device))
        self.register_buffer("scales", scale.to(like.device, like.dtype))
        self.bias = linear.bias
        self.gemm: QuantGemm | None = None
        # Read by forward instead of ``gemm``: a compiled stack's saved guards pickle what its
        # trace read, and our kernel's object does not pickle.
        self.ours = ours
        if ours:
            self.use_threads(torch.get_num_threads())

    def use_threads(self, threads: int) -> None:
        """Our kernel, on ``threads`` of torch's OpenMP team (``packed.pack_linears``: the engine's)."""
        n, k = self.out_features, self.in_features
        self.gemm = QuantGemm.int8(self.weight, self.scales, self.bias, n=n, k=k, num_threads=threads)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.ours:
            return GraphLinear.forward(self, x)
        rows = x.reshape(-1, self.in_features)
        y = torch._weight_int8pack_mm(rows, self.weight, self.scales)
        if self.bias is not None:
            y = y + self.bias
        return y.reshape(*x.shape[:-1], self.out_features)

    def linear(self, x: torch.Tensor) -> torch.Tensor:
        assert self.gemm is not None, "our kernel's path only"
        return _run(self.gemm, x, self.in_features, self.out_features)

    def dequantized(self) -> torch.Tensor:
        """The weight the kernel multiplies by, in the scales' dtype (tests compare against it)."""
        q = self.weight
        if self.gemm is not None:
            q = unpack_int8(q, self.out_features, self.in_features)
        return q.to(self.scales.dtype) * self.scales[:, None]


# int4 group sizes, largest first: the first that divides a linear's input width is its own.
INT4_GROUPS = (128, 64, 32)
# tinygemm's packing takes output widths in multiples of 16; on CUDA, tiles of this many 16-wide
# slices of the input width (2: input widths in multiples of 32, as every group size is).
INT4_ROWS, _CUDA_INNER_K_TILES = 16, 2
# tinygemm's CUDA kernel needs Ampere's tensor cores, and takes bfloat16 only; elsewhere on CUDA
# our Triton kernel multiplies (``cuda/grouped_gemm.py``).
TINYGEMM_CUDA_CAPABILITY = (8, 0)


def tinygemm_runs(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether torch's tinygemm int4 kernel runs on CUDA ``device`` in ``dtype``."""
    return dtype == torch.bfloat16 and runtime().capability(device) >= TINYGEMM_CUDA_CAPABILITY


def quantize_int4(w: torch.Tensor, group: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``w`` ``[out, in]`` as 4-bit values ``q`` in 0..15 (int32, one per weight) and float32
    ``scale`` and ``zero`` ``[out, in / group]``, tinygemm's convention: ``w ≈ (q - 8) * scale
    + zero``. The group's minimum maps to 0 and its maximum to 15; a constant group gets scale 0."""
    out, cols = w.shape
    g = w.detach().float().reshape(out, cols // group, group)
    lo, hi = g.amin(dim=-1), g.amax(dim=-1)
    scale = (hi - lo) / 15
    steps = (g - lo[..., None]) / scale.clamp_min(torch.finfo(torch.float32).tiny)[..., None]
    q = torch.round(steps).clamp_(0, 15).to(torch.int32).reshape(out, cols)
    return q, scale, lo + 8 * scale


def int4_group_size(in_features: int) -> int | None:
    """The group size of a linear with ``in_features`` input columns (None: no group divides it)."""
    return next((g for g in INT4_GROUPS if in_features % g == 0), None)


def int4_group(linear: nn.Linear) -> int:
    """The group size for ``linear``, or ``ModelLoadError`` naming the width the kernel cannot take."""
    if linear.out_features % INT4_ROWS:
        raise ModelLoadError(
            f"--quantization int4 needs output widths in multiples of {INT4_ROWS}; a linear has "
            f"{linear.out_features}"
        )
    group = int4_group_size(linear.in_features)
    if group is None:
        raise ModelLoadError(
            f"--quantization int4 needs input widths in multiples of {INT4_GROUPS[-1]} (its group "
            f"size); a linear has {linear.in_features}"
        )
    return group


class Int4Blocks(NamedTuple):
    """A weight in ``Int4Linear``'s form, ``w[:, order[j]] = (q[:, j] - 8) * scale + zero`` with
    each scale and zero over a group of consecutive columns ``j``: ``q`` uint8 ``[out, in]``
    (0..15), ``scale`` and ``zero`` float32 ``[out, in / group]``, ``order`` the input column
    each of ``q``'s stands for (None: in order; act-order GPTQ's groups are scattered)."""

    q: torch.Tensor
    scale: torch.Tensor
    zero: torch.Tensor
    order: torch.Tensor | None = None

    @property
    def group(self) -> int:
        return self.q.shape[1] // self.scale.shape[1]

    def values(self) -> torch.Tensor:
        """What the scales multiply, float32."""
        return self.q.float() - 8

    def regrouped(self, group: int) -> Int4Blocks:
        """The same weight in groups of ``group`` (dividing this one's), scales and zeros repeated."""
        rep = self.group // group
        scale, zero = (t.repeat_interleave(rep, dim=1) for t in (self.scale, self.zero))
        return type(self)(self.q, scale, zero, self.order)

    def as_int8(self) -> Int8Blocks:
        """The same weight as grouped int8 (``q - 8`` is exact in int8)."""
        return Int8Blocks((self.q.to(torch.int16) - 8).to(torch.int8), self.scale, self.zero, self.order)

    def dequantized(self) -> torch.Tensor:
        """The float32 weight, its columns in input order."""
        w = self.values().reshape(*self.scale.shape, self.group) * self.scale[..., None]
        w = (w + self.zero[..., None]).reshape(self.q.shape)
        if self.order is None:
            return w
        out = torch.empty_like(w)
        out[:, self.order] = w
        return out


class Int8Blocks(Int4Blocks):
    """A weight as ``Int4Blocks``, but ``q`` int8 (any value) and ``w = q * scale + zero``: a
    GGUF's blocks of 2 to 8 bits but Q4's, 8-bit GPTQ, kept as a ``GroupedInt8Linear``."""

    __slots__ = ()

    def values(self) -> torch.Tensor:
        return self.q.float()

    def as_int8(self) -> Int8Blocks:
        return self


def common_form(parts: list[Int4Blocks]) -> list[Int4Blocks] | None:
    """The parts of one linear in one form and group size: int4 parts as grouped int8 where
    another part is int8 (a Q4_K_M GGUF's Q4_K q and k beside its Q6_K v), each in the smallest
    group; None where the groups do not nest."""
    group = min(b.group for b in parts)
    if any(b.group % group for b in parts):
        return None
    if any(isinstance(b, Int8Blocks) for b in parts):
        parts = [b.as_int8() for b in parts]
    return [b if b.group == group else b.regrouped(group) for b in parts]


class GroupedLinear(GraphLinear, nn.Module):
    """An ``nn.Linear`` whose weight is ``bits``-wide values with a scale and a zero per group and
    output row (``[in / group, out, 2]``, the model dtype), the input gathered into the blocks'
    column ``order`` first, if any (act-order GPTQ); the output is in the input's dtype. Packed
    for the ``kernel`` that multiplies it on the model's device and dtype (``home``: a tensor of
    them, where ``linear``'s weight is not: on the host, read from the checkpoint, or never
    allocated):

    - ``ours``: our Rust kernel (``quant_kernel_applies``), ``gemm`` its object;
    - ``triton``: our Triton GEMM on CUDA (``cuda/grouped_gemm.py``);
    - ``tinygemm``, ``tinygemm_cpu``: torch's int4 kernels (4 bits only)."""

    bits: int
    packed: torch.Tensor
    scales_zeros: torch.Tensor
    order: torch.Tensor | None

    def __init__(self, linear: nn.Linear, blocks: Int4Blocks, home: torch.Tensor) -> None:
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        device, dtype = home.device, home.dtype
        self.group = blocks.group
        q, scale, zero, order = blocks
        self.register_buffer("order", None if order is None else order.to(device))
        sz = torch.stack([scale, zero], dim=-1).transpose(0, 1).contiguous()
        self.register_buffer("scales_zeros", sz.to(device, dtype))
        self.bias = linear.bias
        self.gemm: QuantGemm | None = None
        # Packed where q is (the host, for a checkpoint's blocks) and only then moved: the device
        # never holds a wider copy of the weight than its packed bytes.
        if quant_kernel_applies(device, dtype):
            self.kernel = "ours"
            self.register_buffer("packed", pack_int4(q.to(torch.int32)) if self.bits == 4 else pack_int8(q))
            self.use_threads(torch.get_num_threads())
        elif device.type == "cuda" and not (self.bits == 4 and tinygemm_runs(device, dtype)):
            from neo_rs.model.cuda.grouped_gemm import grouped_gemm, pack_for_triton  # noqa: PLC0415 (Triton)

            self.kernel = "triton"
            self.register_buffer("packed", pack_for_triton(q, self.bits).to(device))
            self._triton_gemm = grouped_gemm  # bound once: forward runs per layer and step
        else:
            assert self.bits == 4, "only our kernels multiply grouped int8 (grouped_int8_runs)"
            q = q.to(torch.int32)
            if device.type == "cuda":
                self.kernel = "tinygemm"
                pairs = (q[:, ::2] << 4 | q[:, 1::2]).to(device, torch.uint8)
                self.register_buffer("packed", torch._convert_weight_to_int4pack(pairs, _CUDA_INNER_K_TILES))
            else:
                self.kernel = "tinygemm_cpu"
                self.register_buffer("packed", torch._convert_weight_to_int4pack_for_cpu(q.to(device), 1))

    def use_threads(self, threads: int) -> None:
        """Our kernel, on ``threads`` of torch's OpenMP team (``packed.pack_linears``: the engine's).
        It takes the scales and zeros per block of 16 columns and group (``groups_by_block``)."""
        n, k = self.out_features, self.in_features
        by_block = groups_by_block(self.scales_zeros, n)
        self.gemm = QuantGemm.grouped(
            self.packed, by_block, self.bias, n=n, k=k, group=self.group, bits=self.bits, num_threads=threads
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # ``kernel``, not ``gemm``: see Int8Linear's ``ours``.
        if self.kernel == "ours":
            return GraphLinear.forward(self, x)
        return self.linear(x)

    def linear(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.reshape(-1, self.in_features)
        if self.order is not None:
            rows = rows.index_select(1, self.order)
        if self.kernel == "ours":
            assert self.gemm is not None, "use_threads() made it"
            y = _run(self.gemm, rows, self.in_features, self.out_features)  # the kernel adds the bias
            return y.view(*x.shape[:-1], self.out_features)
        if self.kernel == "triton":
            y = self._triton_gemm(rows, self.packed, self.scales_zeros, self.group, self.bits)
        else:
            mm = torch._weight_int4pack_mm if self.kernel == "tinygemm" else torch._weight_int4pack_mm_for_cpu
            y = mm(rows, self.packed, self.group, self.scales_zeros)
        if self.bias is not None:
            y = y + self.bias
        return y.reshape(*x.shape[:-1], self.out_features)


class Int4Linear(GroupedLinear):
    """A ``GroupedLinear`` of 4-bit values, tinygemm's ``w = (q - 8) * scale + zero``: ``blocks``
    already quantized (a GGUF's, GPTQ's, AWQ's), else ``linear``'s weight quantized."""

    bits = 4

    def __init__(
        self, linear: nn.Linear, blocks: Int4Blocks | None = None, home: torch.Tensor | None = None
    ) -> None:
        if blocks is None:
            blocks = Int4Blocks(*quantize_int4(linear.weight, int4_group(linear)))
        super().__init__(linear, blocks, linear.weight if home is None else home)

    def dequantized(self, q: torch.Tensor) -> torch.Tensor:
        """The weight the kernel multiplies by, given the values ``q`` it packed (tests), in the
        scales' dtype."""
        return _dequantized(Int4Blocks, q, self.scales_zeros, self.order)


class GroupedInt8Linear(GroupedLinear):
    """A ``GroupedLinear`` of ``Int8Blocks``, ``w = q * scale + zero``, which only our kernels run
    (``grouped_int8_runs``; elsewhere such blocks are dequantized at load)."""

    bits = 8

    def __init__(self, linear: nn.Linear, blocks: Int8Blocks, home: torch.Tensor) -> None:
        assert keeps(blocks, home), "only our kernels run grouped int8"
        super().__init__(linear, blocks, home)

    def dequantized(self) -> torch.Tensor:
        """The weight our Rust kernel multiplies by, its columns in input order, in the scales'
        dtype (tests)."""
        assert self.kernel == "ours", "our Rust kernel's layout"
        q = unpack_int8(self.packed, self.out_features, self.in_features)
        return _dequantized(Int8Blocks, q, self.scales_zeros, self.order)


def _dequantized(
    form: type[Int4Blocks], q: torch.Tensor, scales_zeros: torch.Tensor, order: torch.Tensor | None
) -> torch.Tensor:
    """The weight of values ``q`` in ``form`` by ``scales_zeros`` (``[in / group, out, 2]``), in
    their dtype (the linears' ``dequantized``, for tests)."""
    scale, zero = scales_zeros.float().unbind(-1)
    return form(q, scale.t(), zero.t(), order).dequantized().to(scales_zeros.dtype)


def grouped_int8_runs(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether a kernel multiplies grouped int8 (``GroupedInt8Linear``) on ``device`` in ``dtype``:
    our Triton GEMM on CUDA, our Rust one where it runs them (``grouped_int8_kernel_applies``); torch
    has none."""
    return device.type == "cuda" or grouped_int8_kernel_applies(device, dtype)


def keeps(blocks: Int4Blocks, home: torch.Tensor) -> bool:
    """Whether a model on the device and in the dtype of ``home`` keeps ``blocks`` as they are:
    int4 on any device, grouped int8 where a kernel runs it (``grouped_int8_runs``)."""
    return not isinstance(blocks, Int8Blocks) or grouped_int8_runs(home.device, home.dtype)


def kept_linear(linear: nn.Linear, blocks: Int4Blocks, home: torch.Tensor) -> nn.Module:
    """``linear`` as the kept module of a checkpoint's ``blocks`` on the device and in the dtype
    of ``home`` (where ``keeps``)."""
    if isinstance(blocks, Int8Blocks):
        return GroupedInt8Linear(linear, blocks, home)
    return Int4Linear(linear, blocks, home)


def decoder_linears(model: nn.Module) -> Iterator[tuple[str, nn.Module, str, nn.Linear]]:
    """(qualified name, parent, attribute, linear) of each decoder layer's linear a quantization
    replaces: attention and dense MLP; not the embeddings, the LM head or an MoE layer (router
    and experts)."""
    for i, layer in enumerate(getattr(model, "decoder_layers", [])):
        for parent, prefix in ((layer, f"layers.{i}."), (layer.mlp, f"layers.{i}.mlp.")):
            if isinstance(parent, SparseMoe):
                continue
            for name, child in list(parent.named_children()):
                if isinstance(child, nn.Linear):
                    yield prefix + name, parent, name, child


def quantizer(method: str, scaled_mm: bool = False) -> Callable[[nn.Linear, torch.Tensor], nn.Module]:
    """``method``'s module for a linear whose float weight is on the host, on the device and
    in the dtype of ``home`` (``prequantized.quantize_at_load``). ``scaled_mm``: FP8 multiplies
    in FP8 (``fp8.scaled_mm_runs``)."""
    makers: dict[str, Callable[[nn.Linear, torch.Tensor], nn.Module]] = {
        "int8": lambda linear, home: Int8Linear(linear, home),
        "int4": lambda linear, home: Int4Linear(linear, None, home),
        "fp8": lambda linear, home: Fp8Linear(linear, scaled_mm, home=home),
    }
    return makers[method]


def warn_unquantized_experts(model: nn.Module, method: str) -> None:
    sparse = sum(isinstance(layer.mlp, SparseMoe) for layer in getattr(model, "decoder_layers", []))
    if sparse:
        log.warning("%d MoE layers keep their experts unquantized (%s covers dense linears)", sparse, method)
