"""GGUF's block types kept quantized (``--quantization gguf``, inferred for a ``.gguf`` model),
read by ``gguf_decode.py``:
- Q4_0, Q4_1 and Q4_K store each block of 32 weights of a row as 4-bit values ``q`` with one
  scale and one offset (Q4_K's come from its super-block's 6-bit sub-scales), which is exactly
  ``Int4Linear``'s form in groups of 32, ``w = (q - 8) * scale + zero``;
- Q8_0, Q5_0, Q5_1, Q5_K (groups of 32), Q2_K, Q3_K and Q6_K (of 16) store values of 2 to 8
  bits with a scale (and some an offset) per group: ``GroupedInt8Linear``'s ``w = q * scale +
  zero`` with ``q`` an int8. Only our kernels run that form (``quant.grouped_int8_runs``: the
  Triton GEMM on CUDA, the Rust one on a CPU with AVX512_BF16 in bf16); elsewhere these types are
  dequantized at load, and the log says so.

So the decoder linears whose every part the file stores in a kept type are rebuilt from the
file's blocks, with no requantization (the scales in the model dtype; a linear with 4- and 6-bit
parts, as Q4_K_M files fuse, as grouped int8 in groups of 16); the others keep the weights the
conversion dequantized.

The loader reads the converted checkpoint (``gguf.py``) but for the linears kept here
(``GgufBlocks.weights``), which it leaves unallocated; ``GgufBlocks.keep`` then builds them from
the file's blocks, placed as the loader places a float weight (fused parts, tensor-parallel
shards), so they never exist as floats."""

from __future__ import annotations

from pathlib import Path

from torch import nn

from neo_rs.config import ModelConfig
from neo_rs.model.gguf import (
    GGUF_MODEL_TYPES,
    PERMUTED_QK,
    architecture,
    open_gguf,
    unpermute_qk,
    weight_tensors,
)
from neo_rs.model.gguf_decode import INT4_TYPES, INT8_TYPES, decoded_blocks
from neo_rs.model.prequantized import build_linears, linear_parts
from neo_rs.model.quant import Int4Blocks, decoder_linears
from neo_rs.parallel.shards import TpShard

KEPT_TYPES = INT4_TYPES + INT8_TYPES


class GgufBlocks:
    """GGUF ``path``'s blocks for rank ``shard``: ``weights``, our weights
    (``layers.N.qkv_proj.weight``...) whose every part the file stores in a kept type (those of
    ``INT8_TYPES`` only where ``grouped_int8``: a kernel of ours runs them), for the loader to leave
    unallocated; then ``keep`` builds those linears. ``dequantized_types``: the file's
    ``INT8_TYPES`` of decoder linears left to the loader for want of the kernel. The file is opened once
    (its metadata takes seconds to parse)."""

    def __init__(self, path: str | Path, cfg: ModelConfig, shard: TpShard, grouped_int8: bool) -> None:
        reader = open_gguf(path)
        self.permuted = GGUF_MODEL_TYPES[architecture(reader)] in PERMUTED_QK
        self.heads = {"attn_q": cfg.num_heads, "attn_k": cfg.num_kv_heads}
        # GGUF name -> (the HF name of the weight it is, its tensor, llama.cpp's kind), for each
        # layer's weight matrix.
        self.tensors = {
            tensor.name: (name, tensor, kind)
            for tensor, name, kind in weight_tensors(reader)
            if kind is not None and name.endswith(".weight")
        }
        self.parts = linear_parts(cfg, shard, ((name, key) for key, (name, _, _) in self.tensors.items()))
        self.kept_types = KEPT_TYPES if grouped_int8 else INT4_TYPES
        types = {
            ours: {self.tensors[key][1].tensor_type.name for _, key in found}
            for ours, found in self.parts.items()
        }
        self.weights = {f"{ours}.weight" for ours, kinds in types.items() if kinds <= set(self.kept_types)}
        self.dequantized_types = sorted(set().union(*types.values()) & set(KEPT_TYPES) - set(self.kept_types))

    def _read(self, key: str) -> Int4Blocks | None:
        _, tensor, kind = self.tensors[key]
        name = tensor.tensor_type.name
        if name not in self.kept_types:
            return None
        blocks = decoded_blocks(tensor)
        if self.permuted and kind in self.heads:  # rows: each row's groups move with it
            return type(blocks)(*(unpermute_qk(b, self.heads[kind]) for b in blocks[:3]))
        return blocks

    def keep(self, model: nn.Module) -> tuple[int, int]:
        """Build each of ``model``'s linears ``weights`` names from the file's blocks
        (``quant.kept_linear``); returns (kept, left as floats)."""
        kept, _, _ = build_linears(model, self.parts, self._read, keep=True)
        return kept, len(list(decoder_linears(model)))
