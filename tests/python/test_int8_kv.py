"""The int8 host pool (``cpu_kv_dtype="int8"``): every write rotates and quantizes with the
kernel's rounding, reads for the device dequantize and rotate back, copies in flight poison it
under the emulation; with every decode on the CPU, greedy tokens equal Hugging Face's with a cache
that stores int8 rows the same way (the prompt attends to itself at full precision, as it does on
the device) and, where the kernel takes q·k as int8 dot products, an attention that quantizes
each decode's q the same way."""

from __future__ import annotations

import pytest
import torch
from conftest import ARCHS, assert_all_blocks_free
from neo_rs import LLM, CpuAttention, InvalidArgumentError, SamplingParams
from neo_rs._core import dequantize_rows, quantize_rows
from neo_rs.kv.pools import INT8_POISON, KvLayout, KvPool
from transformers import AttentionInterface, AutoModelForCausalLM, DynamicCache
from transformers.integrations.sdpa_attention import sdpa_attention_forward

PROMPTS = [[256, 72, 105], list(range(10, 47)), [7], list(range(100, 120)), [5, 9, 200, 31] * 4]
MAX_TOKENS = 12


def quantize(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    x = x.contiguous()
    q, s = torch.empty(x.shape, dtype=torch.int8), torch.empty(x.shape[:-1], dtype=torch.float32)
    quantize_rows(x, q, s)
    return q, s


def round_trip(x: torch.Tensor) -> torch.Tensor:
    """``x`` as an int8 row stores it: quantized per row of the last dim, then read back."""
    q, s = quantize(x.float())
    out = torch.empty(x.shape, dtype=torch.float32)
    dequantize_rows(q, s, out)
    return out.to(x.dtype)


def test_quantize_rows_rotates_then_quantizes_symmetrically_and_rejects_bad_buffers() -> None:
    x = torch.tensor([[0.5, -1.0, 0.25, 0.0], [0.0, 0.0, 0.0, 0.0], [3.0, 2.0, -6.0, 1.0]])
    q, s = quantize(x)
    # Rows times the normalized 4x4 Hadamard matrix (Sylvester's), then int8 on max|row| / 127:
    # [0.5, -1, 0.25, 0] -> [-0.125, 0.875, -0.375, 0.625], [3, 2, -6, 1] -> [0, -3, 5, 4].
    h4 = torch.tensor([[1, 1, 1, 1], [1, -1, 1, -1], [1, 1, -1, -1], [1, -1, -1, 1]]) / 2.0
    assert torch.equal(x @ h4, torch.tensor([[-0.125, 0.875, -0.375, 0.625], [0] * 4, [0, -3, 5, 4]]).float())
    assert s.tolist() == pytest.approx([0.875 / 127, 0.0, 5 / 127])
    assert q.tolist() == [[-18, 127, -54, 91], [0, 0, 0, 0], [0, -76, 127, 102]]
    # Read back: dequantized and rotated back, within half a step of each rotated value.
    back = round_trip(x)
    assert (back - x).abs().max() <= (s[:, None] / 2 * 4**0.5).max()
    assert back[1].eq(0).all()
    with pytest.raises(TypeError):  # DTypeError: the scales must be float32
        quantize_rows(x, q, s.double())
    with pytest.raises(ValueError):  # ShapeError
        quantize_rows(x, q[:2], s)
    with pytest.raises(TypeError):  # DTypeError: rows are read back from int8
        dequantize_rows(q.float(), s, torch.empty(3, 4))
    with pytest.raises(ValueError):  # ShapeError
        dequantize_rows(q, s[:2], torch.empty(3, 4))


def test_a_large_channel_does_not_coarsen_the_rest_of_its_row() -> None:
    # A RoPE'd key with one large channel: plain int8 would step every channel by 100/127 (rms
    # error about 0.23); rotated first, the row's max is about 100/8 plus a few, so the error on
    # the other channels stays several times smaller.
    torch.manual_seed(0)
    x = torch.rand(16, 64) * 2 - 1
    x[:, 5] = 100.0
    rms = (round_trip(x) - x)[:, torch.arange(64) != 5].pow(2).mean().sqrt().item()
    assert rms < 0.1


def test_int8_pool_writes_quantize_and_reads_dequantize() -> None:
    torch.manual_seed(0)
    layout = KvLayout(num_layers=2, num_kv_heads=2, block_size=4, head_dim=8, dtype=torch.bfloat16)
    pool = KvPool(layout, 6, torch.device("cpu"), quantized=True)
    assert pool.k.dtype == torch.int8 and pool.k_scale is not None and pool.k_scale.shape == (2, 6, 2, 4)
    assert set(pool.scales()) == {"k_scale", "v_scale"}
    assert layout.bytes_per_block(quantized=True) == 2 * 2 * 2 * 4 * (8 + 4)  # int8 rows and f32 scales
    # Whole blocks (a swap-out), then single slots (host-bound prefill rows).
    k, v = torch.randn(2, 3, 2, 4, 8).bfloat16(), torch.randn(2, 3, 2, 4, 8).bfloat16()
    ids = torch.tensor([5, 0, 3])
    pool.store_blocks((slice(None), ids), k, v)
    got_k, got_v = pool.load_blocks(ids)
    assert got_k.dtype == torch.bfloat16
    assert torch.equal(got_k, round_trip(k)) and torch.equal(got_v, round_trip(v))
    rows = torch.randn(3, 2, 8).bfloat16()
    slots = (torch.tensor([1, 1, 2]), torch.tensor([0, 3, 2]))
    pool.write(1, slots, rows, -rows)
    got_k, _ = pool.load_blocks(torch.tensor([1, 2]))
    assert torch.equal(got_k[1, 0, :, 0], round_trip(rows[0])) and torch.equal(
        got_k[1, 1, :, 2], round_trip(rows[2])
    )
    # A copy in flight leaves a sentinel no quantized row holds, and NaN scales.
    pool.poison_slots(1, slots)
    assert (pool.k[1, 1, :, 0] == INT8_POISON).all() and pool.v_scale[1, 2, :, 2].isnan().all()


def test_bad_cpu_kv_dtype_is_refused() -> None:
    with pytest.raises(InvalidArgumentError, match="cpu_kv_dtype"):
        LLM(cpu_kv_dtype="fp4")


class Int8HostCache(DynamicCache):
    """What ``offload="all"`` with an int8 host pool computes: a prompt attends to its own K/V at
    full precision (its prefill runs on the device); every decode after it attends to int8 rows,
    its own new row included (the fused append quantizes before the kernel reads)."""

    def update(self, key_states, value_states, layer_idx, *args, **kwargs):  # noqa: ANN001, ANN002, ANN003, ANN201
        prefill = self.get_seq_length(layer_idx) == 0
        keys, values = super().update(
            round_trip(key_states), round_trip(value_states), layer_idx, *args, **kwargs
        )
        return (key_states, value_states) if prefill else (keys, values)


def int8_dot_attention(module, query, key, value, attention_mask, scaling=None, **kwargs):  # noqa: ANN001, ANN003, ANN201
    """SDPA, with each decode step's q (scaled) quantized per head as the CPU kernel's int8 dot
    products take it."""
    if query.shape[2] == 1:
        s = scaling if scaling is not None else query.shape[-1] ** -0.5
        query = round_trip(query * s) / s
    return sdpa_attention_forward(module, query, key, value, attention_mask, scaling=scaling, **kwargs)


AttentionInterface.register("neo_int8_dot", int8_dot_attention)


def hf_int8_greedy(path, prompt: list[int]) -> list[int]:  # noqa: ANN001
    attn = "neo_int8_dot" if CpuAttention(num_threads=1).int8_dot else "sdpa"
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation=attn).eval()
    ids = torch.tensor([prompt])
    with torch.no_grad():
        out = model.generate(
            ids,
            attention_mask=torch.ones_like(ids),
            past_key_values=Int8HostCache(),
            max_new_tokens=MAX_TOKENS,
            do_sample=False,
            eos_token_id=None,
            pad_token_id=0,
        )
    return out[0, len(prompt) :].tolist()


@pytest.mark.parametrize("kind", ARCHS)
def test_int8_host_kv_matches_transformers_with_an_int8_cache(checkpoints, kind: str) -> None:
    llm = LLM(
        str(checkpoints[kind]),
        dtype="float32",
        offload="all",
        cpu_kv_dtype="int8",
        num_cpu_blocks=64,
        block_size=8,
    )
    greedy = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
    outs = llm.generate(PROMPTS, greedy, use_tqdm=False)
    tokens = [o.outputs[0].token_ids for o in outs]
    assert tokens == [hf_int8_greedy(checkpoints[kind], p) for p in PROMPTS]
    assert llm.engine.runner.host_pool.k.dtype == torch.int8
    assert llm.engine.runner.cpu_kv_bytes_per_token() < llm.engine.runner.kv_bytes_per_token() / 2 + 16
    assert_all_blocks_free(llm.engine)


@pytest.mark.parametrize("offload", ["none", "neo"])
def test_int8_host_pool_under_swaps_and_the_pipeline(checkpoints, offload: str) -> None:
    # Swap-outs quantize into the host pool, swap-ins dequantize back, neo's host-bound prefills
    # and pipelined CPU decodes read int8: every request finishes, nothing leaks.
    llm = LLM(
        str(checkpoints["llama3"]),
        dtype="float32",
        offload=offload,
        cpu_kv_dtype="int8",
        num_gpu_blocks=10,
        num_cpu_blocks=64,
        block_size=8,
        neo_force_pipeline=offload == "neo",
    )
    greedy = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
    outs = llm.generate(PROMPTS * 2, greedy, use_tqdm=False)
    assert all(len(o.outputs[0].token_ids) == MAX_TOKENS for o in outs)
    st = llm.engine.scheduler.stats()
    if offload == "none":
        assert st["num_swapped_out"] > 0 and st["num_swapped_in"] > 0, st
    else:
        assert st["num_prefills_to_host"] > 0 and st["num_pipelined_steps"] > 0, st
    assert_all_blocks_free(llm.engine)
