"""Greedy outputs token-identical to Hugging Face transformers (fp32) on tiny checkpoints of each
supported architecture (the Llama family, and Qwen3, Phi-3, SmolLM3, OLMo 2, Mixtral and
Qwen3-MoE in every offload mode), also under preemption (swap and recompute), chunked prefill and
requests arriving mid-run; first-step logits within 1e-4."""

from __future__ import annotations

from collections import Counter

import pytest
import torch
from conftest import ARCHS, FAMILIES, assert_all_blocks_free
from neo_rs import LLM, LLMEngine, SamplingParams
from neo_rs.config import EngineArgs

PROMPTS = [
    [256, 72, 105],
    list(range(10, 47)),
    [7],
    list(range(100, 120)),
    list(range(3, 16)),
    [5, 9, 200, 31] * 4,
]
MAX_TOKENS = 12
_hf_cache: dict[tuple[str, int], list[int]] = {}


def hf_greedy(path, kind: str, prompt: list[int], n: int = MAX_TOKENS) -> list[int]:  # noqa: ANN001
    key = (kind, hash(tuple(prompt)))
    if key not in _hf_cache:
        from transformers import AutoModelForCausalLM

        model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
        for p in PROMPTS:
            out = model.generate(
                torch.tensor([p]), max_new_tokens=n, do_sample=False, eos_token_id=None, pad_token_id=0
            )
            _hf_cache[(kind, hash(tuple(p)))] = out[0, len(p) :].tolist()
    return _hf_cache[key]


GREEDY = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)


def run(path, **kwargs) -> tuple[list[list[int]], LLMEngine, Counter]:  # noqa: ANN001
    """Greedy tokens per prompt, the engine, and what its iterations did: CPU decodes run, and
    iterations per mode (gpu-only, sequential, pipelined)."""
    llm = LLM(str(path), dtype="float32", **kwargs)
    engine, seen = llm.engine, Counter()
    step = engine.step

    def counting_step() -> list:
        outs = step()
        if engine.last_stats is not None:
            seen["cpu_decodes"] += engine.last_stats.num_cpu_decodes
            seen[engine.last_stats.mode] += 1
        return outs

    engine.step = counting_step  # type: ignore[method-assign]
    outs = llm.generate(PROMPTS, GREEDY, use_tqdm=False)
    assert all(o.outputs[0].finish_reason == "length" for o in outs)
    return [o.outputs[0].token_ids for o in outs], engine, seen


@pytest.mark.parametrize("kind", ARCHS + FAMILIES)
def test_greedy_matches_transformers(checkpoints, kind: str) -> None:
    tokens, engine, seen = run(checkpoints[kind], num_gpu_blocks=64)
    assert tokens == [hf_greedy(checkpoints[kind], kind, p) for p in PROMPTS]
    assert_all_blocks_free(engine)


@pytest.mark.parametrize("kind", ARCHS + FAMILIES)
def test_first_step_logits_match_transformers(checkpoints, kind: str) -> None:
    from transformers import AutoModelForCausalLM

    engine = LLMEngine(EngineArgs(model=str(checkpoints[kind]), dtype="float32", num_gpu_blocks=64))
    for i, p in enumerate(PROMPTS):
        engine.add_request(p, SamplingParams(max_tokens=1), request_id=str(i))
    plan = engine.scheduler.schedule()
    # Sequence ids count from 0 in arrival order; the batch puts one-token prompts first.
    order = plan.sample_ids.tolist()
    assert sorted(order) == list(range(len(PROMPTS)))
    ours = engine.runner.execute(plan)
    engine.scheduler.update([0] * len(PROMPTS), [])
    for i in range(len(PROMPTS)):
        engine.abort(str(i))
    assert_all_blocks_free(engine)
    hf = AutoModelForCausalLM.from_pretrained(checkpoints[kind], dtype=torch.float32).eval()
    with torch.no_grad():
        want = torch.stack([hf(torch.tensor([PROMPTS[i]])).logits[0, -1] for i in order])
    torch.testing.assert_close(ours.cpu(), want, atol=1e-4, rtol=0)


def test_sharded_checkpoint_loads_the_same_weights(checkpoints) -> None:
    tokens, engine, seen = run(checkpoints["llama-sharded"], num_gpu_blocks=64)
    assert_all_blocks_free(engine)
    assert tokens == [hf_greedy(checkpoints["llama"], "llama", p) for p in PROMPTS]


@pytest.mark.parametrize(("num_cpu_blocks", "stat"), [(64, "num_swapped_out"), (0, "num_recomputed")])
def test_preemption_keeps_outputs_identical(checkpoints, num_cpu_blocks: int, stat: str) -> None:
    # 8-token blocks; the longest prompt + outputs needs 7 of them, the batch ~20.
    tokens, engine, seen = run(
        checkpoints["llama3"], num_gpu_blocks=8, block_size=8, num_cpu_blocks=num_cpu_blocks
    )
    assert tokens == [hf_greedy(checkpoints["llama3"], "llama3", p) for p in PROMPTS]
    assert engine.scheduler.stats()[stat] > 0
    if stat == "num_swapped_out":
        assert engine.scheduler.stats()["num_swapped_in"] == engine.scheduler.stats()["num_swapped_out"]
    assert_all_blocks_free(engine)


@pytest.mark.parametrize("kind", ["llama", "qwen2"])
def test_all_decodes_on_the_cpu_keep_outputs_identical(checkpoints, kind: str) -> None:
    # offload="all": every finished prefill moves to the host pool layer by layer, every decode
    # runs the Rust kernel over the host pool with the fused append. Chunked prefill too.
    tokens, engine, seen = run(
        checkpoints[kind],
        offload="all",
        num_gpu_blocks=16,
        num_cpu_blocks=64,
        block_size=8,
        max_num_batched_tokens=24,
    )
    assert tokens == [hf_greedy(checkpoints[kind], kind, p) for p in PROMPTS]
    assert engine.scheduler.stats()["num_prefills_to_host"] == len(PROMPTS)
    assert seen["cpu_decodes"] >= len(PROMPTS) * (MAX_TOKENS - 1) and seen["gpu-only"] <= len(PROMPTS), seen
    assert_all_blocks_free(engine)


@pytest.mark.parametrize("kind", ["llama3", "mistral"])
def test_neo_pipeline_keeps_outputs_identical(checkpoints, kind: str) -> None:
    # A device pool too small for the batch and a small token budget: whole prompts land in the
    # host pool, chunked ones on the device, requests swap out and back in mid-generation, and
    # (forced here) iterations run as the two-sub-batch pipeline.
    tokens, engine, seen = run(
        checkpoints[kind],
        offload="neo",
        num_gpu_blocks=10,
        num_cpu_blocks=64,
        block_size=8,
        max_num_batched_tokens=24,
        neo_force_pipeline=True,
    )
    assert tokens == [hf_greedy(checkpoints[kind], kind, p) for p in PROMPTS]
    st = engine.scheduler.stats()
    assert st["num_pipelined_steps"] > 0 and st["num_prefills_to_host"] > 0, st
    assert seen["pipelined"] == st["num_pipelined_steps"] and seen["cpu_decodes"] > 0, seen
    assert st["num_swapped_out"] > 0 and st["num_swapped_in"] > 0, st
    assert_all_blocks_free(engine)


def test_neo_with_profiled_estimates_keeps_outputs_identical(checkpoints) -> None:
    # Whatever mix the profiled predictor picks on this machine, the tokens do not change.
    tokens, engine, seen = run(
        checkpoints["qwen2"], offload="neo", num_gpu_blocks=10, num_cpu_blocks=64, block_size=8
    )
    assert tokens == [hf_greedy(checkpoints["qwen2"], "qwen2", p) for p in PROMPTS]
    assert_all_blocks_free(engine)


def test_all_mode_with_a_full_host_pool_recomputes(checkpoints) -> None:
    tokens, engine, seen = run(
        checkpoints["llama3"], offload="all", num_gpu_blocks=16, num_cpu_blocks=8, block_size=8
    )
    assert tokens == [hf_greedy(checkpoints["llama3"], "llama3", p) for p in PROMPTS]
    assert engine.scheduler.stats()["num_recomputed"] > 0
    assert_all_blocks_free(engine)


# Pools per offload mode, small enough that requests swap (none), decode from the host pool in
# the forced pipeline (neo) or move there after prefill (all).
MODES = {
    "none": dict(num_gpu_blocks=8, num_cpu_blocks=64, block_size=8),
    "neo": dict(num_gpu_blocks=7, num_cpu_blocks=64, block_size=8, neo_force_pipeline=True),
    "all": dict(num_gpu_blocks=16, num_cpu_blocks=64, block_size=8),
}


@pytest.mark.parametrize("offload", list(MODES))
def test_chunked_prefill_keeps_outputs_identical(checkpoints, offload: str) -> None:
    tokens, engine, seen = run(
        checkpoints["qwen2"], offload=offload, max_num_batched_tokens=5, **MODES[offload]
    )
    assert tokens == [hf_greedy(checkpoints["qwen2"], "qwen2", p) for p in PROMPTS]
    assert (seen["cpu_decodes"] > 0) == (offload != "none"), seen
    assert_all_blocks_free(engine)


@pytest.mark.parametrize("offload", list(MODES))
def test_requests_arriving_mid_run_and_aborts(checkpoints, offload: str) -> None:
    args = EngineArgs(model=str(checkpoints["mistral"]), dtype="float32", offload=offload, **MODES[offload])
    engine = LLMEngine(args)
    got: dict[str, list[int]] = {}
    pending = list(enumerate(PROMPTS))
    steps = cpu_decodes = 0
    while pending or engine.has_unfinished():
        if pending and steps % 3 == 0:
            i, p = pending.pop(0)
            engine.add_request(p, GREEDY, request_id=str(i))
        if steps == 7:
            assert engine.abort("1") is not None  # mid-generation, its blocks in either pool
        for out in engine.step():
            if out.finished:
                got[out.request_id] = out.outputs[0].token_ids
        cpu_decodes += engine.last_stats.num_cpu_decodes if engine.last_stats else 0
        steps += 1
    assert (cpu_decodes > 0) == (offload != "none"), cpu_decodes
    assert "1" not in got
    kept = [i for i in range(len(PROMPTS)) if i != 1]
    assert [got[str(i)] for i in kept] == [
        hf_greedy(checkpoints["mistral"], "mistral", PROMPTS[i]) for i in kept
    ]
    assert_all_blocks_free(engine)


# Gemma's sliding and global layers form two KV groups: a block holds half the layers, and the
# sliding group's blocks go behind the window. Pools that still run out (and so swap, or pipeline).
HYBRID_POOLS = {
    (kind, offload): {"num_gpu_blocks": blocks}
    for kind in ("gemma2", "gemma3")
    for offload, blocks in (("none", 12), ("neo", 12))
}


@pytest.mark.parametrize("offload", list(MODES))
@pytest.mark.parametrize("kind", FAMILIES)
def test_newer_families_in_every_offload_mode(checkpoints, kind: str, offload: str) -> None:
    pool = {**MODES[offload], **HYBRID_POOLS.get((kind, offload), {})}
    tokens, engine, seen = run(checkpoints[kind], offload=offload, **pool)
    assert tokens == [hf_greedy(checkpoints[kind], kind, p) for p in PROMPTS]
    st = engine.scheduler.stats()
    if offload == "none":
        assert st["num_swapped_out"] > 0 and seen["cpu_decodes"] == 0, (st, seen)
    elif offload == "neo":
        assert seen["pipelined"] > 0 and seen["cpu_decodes"] > 0, seen
    else:
        assert st["num_prefills_to_host"] == len(PROMPTS) and seen["cpu_decodes"] > 0, (st, seen)
    assert_all_blocks_free(engine)


def test_longrope_tables_match_transformers_on_both_sides_of_the_original_length(checkpoints) -> None:
    # Phi-3's fixture switches factors at position 64 (past the parity tests' sequences).
    # transformers rotates a sequence longer than that with the long factors throughout (its
    # generate recomputes the cache when a sequence crosses it); we rotate each position by the
    # factors of its side, so a sequence never crossing matches it exactly (the parity tests
    # above) and, beyond, each position's rotation is transformers' long one.
    from neo_rs.config import ModelConfig
    from neo_rs.model.decoder import Rotary
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(checkpoints["phi3"], dtype=torch.float32).model.rotary_emb
    ours = Rotary(ModelConfig.from_dir(checkpoints["phi3"]), 80)
    ours.fill_tables()
    x = torch.zeros(1)
    short_cos, short_sin = hf(x, torch.arange(64)[None])
    long_cos, long_sin = hf(x, torch.arange(80)[None])
    assert not torch.allclose(short_cos[0], long_cos[0, :64])  # the two sides differ
    torch.testing.assert_close(ours.cos[0, :64], short_cos[0], rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(ours.sin[0, :64], short_sin[0], rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(ours.cos[0, 64:], long_cos[0, 64:], rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(ours.sin[0, 64:], long_sin[0, 64:], rtol=1e-6, atol=1e-6)


def test_prompts_attend_as_kernel_rows_without_dot_products(checkpoints, monkeypatch) -> None:
    # On a CPU device a prompt's first chunk of up to FIRST_CHUNK_KERNEL_ROWS_MAX rows attends in
    # the Rust kernel, a decode row per token, on the engine without dot products; longer ones
    # by SDPA (the cap lowered here so that the prompts take both ways).
    from neo_rs.attention import metadata

    monkeypatch.setattr(metadata, "FIRST_CHUNK_KERNEL_ROWS_MAX", 16)
    llm = LLM(str(checkpoints["llama"]), dtype="float32", num_gpu_blocks=64)
    attention = llm.engine.runner.attention
    engine = attention.prompt_attention
    assert engine is not None and not engine.bf16_dot and not engine.int8_dot
    assert engine.num_threads == attention.cpu_attention.num_threads
    rows: list[int] = []

    class Recording:
        def forward(self, q: torch.Tensor, *args, **kwargs) -> None:  # noqa: ANN002, ANN003
            rows.append(q.shape[0])
            engine.forward(q, *args, **kwargs)

    attention.prompt_attention = Recording()
    outs = llm.generate(PROMPTS, GREEDY, use_tqdm=False)
    want = [hf_greedy(checkpoints["llama"], "llama", p) for p in PROMPTS]
    assert [o.outputs[0].token_ids for o in outs] == want
    layers = len(llm.engine.runner.model.decoder_layers)
    # (A one-token prompt is a decode at position 0.)
    assert Counter(rows) == Counter({len(p): layers for p in PROMPTS if 1 < len(p) <= 16}), rows
