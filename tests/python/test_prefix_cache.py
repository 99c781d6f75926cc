"""Automatic prefix caching: prompts that share full blocks with earlier ones start after them,
with greedy tokens identical to Hugging Face transformers and to caching off, in every offload
mode, from the device cache and from its host tier, under preemption (swap and recompute) and
aborts, and for n > 1 samples of one prompt."""

from __future__ import annotations

import pytest
import torch
from conftest import assert_all_blocks_free
from neo_rs import LLM, LLMEngine, SamplingParams
from neo_rs.config import EngineArgs
from neo_rs.errors import InvalidArgumentError

SYSTEM = list(range(40, 61))  # 21 tokens: two full 8-token blocks and 5 more
PROMPTS = [
    SYSTEM + [7, 8, 9],
    SYSTEM[:16],  # exactly the two cached blocks: the second is recomputed for the logits
    SYSTEM[:20] + [200, 201],  # diverges mid-block: hits two blocks, computes the rest
    SYSTEM + [11],
    [3, 4, 5, 6],
    SYSTEM[:12] + [9] * 10,  # diverges inside block 1: hits block 0 only
    list(range(100, 130)),  # shares nothing: with a small device pool, evicts the others
]
MAX_TOKENS = 10
GREEDY = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
MODES = {
    "none": dict(num_gpu_blocks=64, num_cpu_blocks=64),
    "neo": dict(num_gpu_blocks=64, num_cpu_blocks=64, neo_force_pipeline=True),
    "all": dict(num_gpu_blocks=64, num_cpu_blocks=64, max_num_batched_tokens=16),
}
_hf: dict[tuple[str, tuple[int, ...]], list[int]] = {}


def hf_greedy(path, prompt: list[int]) -> list[int]:  # noqa: ANN001
    key = (str(path), tuple(prompt))
    if key not in _hf:
        from transformers import AutoModelForCausalLM

        model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
        for p in PROMPTS:
            out = model.generate(
                torch.tensor([p]),
                max_new_tokens=MAX_TOKENS,
                do_sample=False,
                eos_token_id=None,
                pad_token_id=0,
            )
            _hf[(str(path), tuple(p))] = out[0, len(p) :].tolist()
    return _hf[key]


def one_by_one(
    engine: LLMEngine,
    prompts: list[list[int]],
    params: SamplingParams = GREEDY,
    cached: list[int] | None = None,
) -> list[list[int]]:
    """Each prompt after the previous one finished, so that its prefix is cached; ``cached``
    collects each one's ``num_cached_tokens``."""
    outs = []
    for i, p in enumerate(prompts):
        engine.add_request(p, params, request_id=str(i))
        while engine.has_unfinished():
            for o in engine.step():
                if o.finished:
                    outs.append(o.outputs[0].token_ids)
                    if cached is not None:
                        cached.append(o.num_cached_tokens)
    return outs


@pytest.mark.parametrize("offload", list(MODES))
def test_hits_at_block_boundaries_and_mid_block_keep_tokens_identical(checkpoints, offload: str) -> None:
    path = checkpoints["llama3"]
    engine = LLM(str(path), dtype="float32", block_size=8, offload=offload, **MODES[offload]).engine
    cached: list[int] = []
    tokens = one_by_one(engine, PROMPTS, cached=cached)
    assert tokens == [hf_greedy(path, p) for p in PROMPTS]
    assert cached == [0, 8, 16, 16, 0, 8, 0]  # what each request reports (usage's cached_tokens)
    st = engine.scheduler.stats()
    assert st["prefix_cache_queries"] == sum(len(p) for p in PROMPTS), st
    # Prompt 1 hits 8 tokens, 2 and 3 hit 16, 5 hits 8 (prompts 0 and 4 miss). Under "all"
    # the prompts are chunked (16-token budget), so their device blocks are cached before they
    # move to the host pool.
    assert st["prefix_cache_hits"] == 8 + 16 + 16 + 8, st
    assert_all_blocks_free(engine)
    off = LLM(
        str(path),
        dtype="float32",
        block_size=8,
        offload=offload,
        enable_prefix_caching=False,
        **MODES[offload],
    ).engine
    cached.clear()
    assert one_by_one(off, PROMPTS, cached=cached) == tokens
    assert off.scheduler.stats()["prefix_cache_hits"] == 0 and cached == [0] * len(PROMPTS)


@pytest.mark.parametrize("offload", list(MODES))
def test_prefixes_evicted_to_the_host_tier_are_copied_back(checkpoints, offload: str) -> None:
    path = checkpoints["llama3"]
    # A small device pool: prompt 6 evicts the tail of prompt 0's cached blocks into the host
    # tier (a quarter of the 64 host blocks); prompts 3 and 6 again then find their first
    # blocks on the device and the next in the host tier. Under "all" the device holds only
    # prefills (their KV moves to the host), so it is smaller still.
    kw = {**MODES[offload], "num_gpu_blocks": 5 if offload == "all" else 6}
    engine = LLM(str(path), dtype="float32", block_size=8, offload=offload, **kw).engine
    assert engine.runner.num_cpu_prefix_blocks == 16
    order = [0, 6, 3, 6, 2]
    tokens = one_by_one(engine, [PROMPTS[i] for i in order])
    assert tokens == [hf_greedy(path, PROMPTS[i]) for i in order]
    st = engine.scheduler.stats()
    assert st["prefix_cache_host_hits"] >= 2 * 8 and st["num_cache_blocks_to_device"] >= 2, st
    # Under "all" every prompt's KV ends in the host pool, whose cache keeps it: the device's
    # evictions are there already.
    assert st["num_cache_blocks_to_host"] >= (3 if offload != "all" else 0), st
    assert_all_blocks_free(engine)


def test_under_neo_a_host_bound_prompt_decodes_in_place_over_host_blocks(checkpoints) -> None:
    path = checkpoints["llama3"]
    engine = LLM(
        str(path), dtype="float32", block_size=8, offload="neo", num_gpu_blocks=5, num_cpu_blocks=64
    ).engine
    assert one_by_one(engine, [PROMPTS[0]]) == [hf_greedy(path, PROMPTS[0])]
    # Prompt 6 takes the whole device pool as it grows, evicting prompt 0's cached blocks into
    # the host tier. Prompt 3 then finds no device room: its KV goes to the host pool, and it
    # starts after the two system-prompt blocks there, its last 6 tokens attending on the CPU.
    got: dict[str, list[int]] = {}
    engine.add_request(PROMPTS[6], GREEDY, request_id="6")
    while engine.scheduler.num_free_blocks("gpu") > 0:
        engine.step()
    engine.add_request(PROMPTS[3], GREEDY, request_id="3")
    while engine.has_unfinished():
        for o in engine.step():
            if o.finished:
                got[o.request_id] = o.outputs[0].token_ids
    assert got == {"6": hf_greedy(path, PROMPTS[6]), "3": hf_greedy(path, PROMPTS[3])}
    st = engine.scheduler.stats()
    assert st["prefix_cache_host_hits"] == 16 and st["num_cache_blocks_to_device"] == 0, st
    assert st["num_prefills_to_host"] == 1, st
    assert_all_blocks_free(engine)


@pytest.mark.parametrize(("num_cpu_blocks", "stat"), [(64, "num_swapped_out"), (0, "num_recomputed")])
def test_preemption_and_abort_of_requests_holding_shared_blocks(
    checkpoints, num_cpu_blocks: int, stat: str
) -> None:
    path = checkpoints["llama3"]
    args = EngineArgs(
        model=str(path), dtype="float32", block_size=8, num_gpu_blocks=6, num_cpu_blocks=num_cpu_blocks
    )
    engine = LLMEngine(args)
    # Warm the cache, then run the sharing prompts together on a pool too small for all of them.
    assert one_by_one(engine, PROMPTS[:1]) == [hf_greedy(path, PROMPTS[0])]
    got: dict[str, list[int]] = {}
    for i, p in enumerate(PROMPTS[1:4], start=1):
        engine.add_request(p, GREEDY, request_id=str(i))
    engine.add_request(SYSTEM + [5], GREEDY, request_id="aborted")
    steps = 0
    while engine.has_unfinished():
        if steps == 3:
            assert engine.abort("aborted") is not None  # it holds the shared blocks too
        for o in engine.step():
            if o.finished:
                got[o.request_id] = o.outputs[0].token_ids
        steps += 1
    assert "aborted" not in got
    assert [got[str(i)] for i in (1, 2, 3)] == [hf_greedy(path, p) for p in PROMPTS[1:4]]
    st = engine.scheduler.stats()
    assert st[stat] > 0 and st["prefix_cache_hits"] > 0, st
    assert_all_blocks_free(engine)


def test_n_samples_of_one_prompt_share_its_blocks(checkpoints) -> None:
    path = checkpoints["llama3"]
    # A small token budget prefills the copies one after another: later ones hit the first's.
    llm = LLM(str(path), dtype="float32", block_size=8, num_gpu_blocks=64, max_num_batched_tokens=24)
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True, n=3)
    (out,) = llm.generate([PROMPTS[0]], params, use_tqdm=False)
    assert [o.token_ids for o in out.outputs] == [hf_greedy(path, PROMPTS[0])] * 3
    assert llm.engine.scheduler.stats()["prefix_cache_hits"] >= 16
    assert_all_blocks_free(llm.engine)


def test_cache_salt_keeps_tenants_apart(checkpoints) -> None:
    path = checkpoints["llama3"]
    engine = LLM(str(path), dtype="float32", block_size=8, num_gpu_blocks=64).engine

    def hit_tokens(salt: str | None) -> int:
        before = engine.scheduler.stats()["prefix_cache_hits"]
        engine.add_request(PROMPTS[0], GREEDY, cache_salt=salt)
        while engine.has_unfinished():
            engine.step()
        return engine.scheduler.stats()["prefix_cache_hits"] - before

    assert [hit_tokens(s) for s in ("a", "a", "b", None, None)] == [0, 16, 0, 0, 16]
    with pytest.raises(InvalidArgumentError, match="cache_salt"):
        engine.add_request(PROMPTS[0], GREEDY, cache_salt="")
    assert_all_blocks_free(engine)


def test_server_flag_turns_it_off() -> None:
    from neo_rs.serve.cli import engine_args, parse_args

    assert engine_args(parse_args([])).enable_prefix_caching
    assert not engine_args(parse_args(["--no-enable-prefix-caching"])).enable_prefix_caching
    assert engine_args(parse_args(["--cpu-prefix-cache-gib", "0.5"])).cpu_prefix_cache_gib == 0.5


def test_host_tier_size(checkpoints) -> None:
    path = checkpoints["llama3"]
    sizes = {}
    for name, kw in {
        "default": {},
        "none": dict(cpu_prefix_cache_gib=0),
        "capped": dict(cpu_prefix_cache_gib=1e3),
        "off": dict(enable_prefix_caching=False),
    }.items():
        args = EngineArgs(model=str(path), block_size=8, num_gpu_blocks=8, num_cpu_blocks=40, **kw)
        sizes[name] = LLMEngine(args).runner.num_cpu_prefix_blocks
    assert sizes == {"default": 10, "none": 0, "capped": 40, "off": 0}
    with pytest.raises(InvalidArgumentError, match="cpu_prefix_cache_gib"):
        LLMEngine(EngineArgs(model=str(path), cpu_prefix_cache_gib=float("nan")))
