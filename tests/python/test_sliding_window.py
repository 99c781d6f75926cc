"""KV memory that follows a sliding window: on a model whose every layer slides (Mistral v0.1
style), generations ten windows long hold about a window of blocks each, in every offload mode
and on the CUDA path (fake, ``fake_cuda.py``), and still match transformers token for token; a
hybrid model (Gemma 2/3) keeps every block of its global layers' group and a window of its
sliding layers' group, and matches as far."""

from __future__ import annotations

from collections import Counter

import pytest
import torch
from conftest import assert_all_blocks_free, hf_greedy_ids, make_checkpoint
from neo_rs import LLM, SamplingParams
from test_fake_cuda import engine_on, fake_gpu, run

WINDOW, BLOCK = 8, 8
PROMPTS = [list(range(10, 30)), [5, 9, 200, 31] * 5, list(range(100, 120))]
NEW = 60  # 20 + 60 tokens: ten windows


@pytest.fixture(scope="module")
def sliding(tmp_path_factory: pytest.TempPathFactory):  # noqa: ANN201 (a path)
    return make_checkpoint(tmp_path_factory.mktemp("ckpt"), "mistral_window")


def _hf(path, prompts: list[list[int]]) -> list[list[int]]:  # noqa: ANN001
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    return [hf_greedy_ids(model, p, NEW) for p in prompts]


def _generate(path, **kwargs) -> tuple[list[list[int]], int, Counter, LLM]:  # noqa: ANN001
    """Greedy tokens, the most blocks in use in both pools after any step, and the steps'
    CPU decodes."""
    llm = LLM(str(path), dtype="float32", block_size=BLOCK, max_num_batched_tokens=24, **kwargs)
    engine, seen = llm.engine, Counter()
    step, sched = engine.step, engine.scheduler

    def counting_step() -> list:
        outs = step()
        used = sum(sched.num_total_blocks(d) - sched.num_free_blocks(d) for d in ("gpu", "cpu"))
        seen["most_blocks"] = max(seen["most_blocks"], used)
        if engine.last_stats is not None:
            seen["cpu_decodes"] += engine.last_stats.num_cpu_decodes
        return outs

    engine.step = counting_step  # type: ignore[method-assign]
    params = SamplingParams(temperature=0, max_tokens=NEW, ignore_eos=True)
    outs = llm.generate(PROMPTS, params, use_tqdm=False)
    return [o.outputs[0].token_ids for o in outs], seen["most_blocks"], seen, llm


@pytest.mark.parametrize("offload", ["none", "neo", "all"])
def test_generations_ten_windows_long_hold_a_window_of_blocks(sliding, offload: str) -> None:
    # 5 device blocks hold 40 tokens: one 80-token request could not even be admitted with
    # every block kept (the scheduler refuses it), and three at once need 30 blocks.
    pipeline = dict(neo_force_pipeline=True) if offload == "neo" else {}
    tokens, most, seen, llm = _generate(
        sliding, offload=offload, num_gpu_blocks=5, num_cpu_blocks=16, **pipeline
    )
    assert tokens == _hf(sliding, PROMPTS)
    # Each holds its window's blocks and one more (and a chunk's worth while prefilling).
    assert most <= len(PROMPTS) * (WINDOW // BLOCK + 1), most
    st = llm.engine.scheduler.stats()
    if offload != "none":
        assert seen["cpu_decodes"] > 0, seen
    if offload == "neo":
        # Requests decoding on the CPU come back to the device with their window's blocks only.
        assert st["num_pipelined_steps"] > 0 and st["num_swapped_in"] > 0, st
        assert st["num_swapped_in_blocks"] <= st["num_swapped_in"] * (WINDOW // BLOCK + 1), st
    assert_all_blocks_free(llm.engine)
    llm.shutdown()


def test_without_the_window_the_same_request_does_not_fit(sliding, tmp_path) -> None:  # noqa: ANN001
    import json
    import shutil

    path = tmp_path / "global"
    shutil.copytree(sliding, path)
    cfg = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps({**cfg, "sliding_window": None}))
    with LLM(str(path), dtype="float32", block_size=BLOCK, num_gpu_blocks=5, num_cpu_blocks=16) as llm:
        with pytest.raises(ValueError, match="KV blocks"):
            llm.generate([PROMPTS[0]], SamplingParams(max_tokens=NEW), use_tqdm=False)


# The hybrid checkpoints' layers (conftest) alternate sliding and global: two KV groups, so a
# block holds half the layers. 80 tokens: 10 global blocks a request; a sliding group holds its
# window's blocks and one more between steps, a chunk's worth more while prefilling (5 at most).
GLOBAL_BLOCKS, SLIDING_PEAK = 80 // BLOCK, (WINDOW - 1 + 24) // BLOCK + 1 + 1


@pytest.mark.parametrize(("kind", "offload"), [("gemma3", "none"), ("gemma3", "neo"), ("gemma2", "all")])
def test_a_hybrid_model_holds_its_global_blocks_and_a_window_of_sliding_ones(
    checkpoints, kind: str, offload: str
) -> None:
    # One request needs 10 + 5 blocks of a pool: 16 admit one at a time on the device (its
    # layers' tables kept whole would take 20 such blocks' bytes); the host pool takes all three
    # (swapped out, or decoding there).
    pipeline = dict(neo_force_pipeline=True) if offload == "neo" else {}
    tokens, most, seen, llm = _generate(
        checkpoints[kind], offload=offload, num_gpu_blocks=16, num_cpu_blocks=64, **pipeline
    )
    assert tokens == _hf(checkpoints[kind], PROMPTS)
    runner = llm.engine.runner
    assert runner.kv_groups.windows == (WINDOW, None)
    # Layers' worth of blocks held in both pools, against what two groups of half the layers
    # each may hold.
    half = runner.model.config.num_layers // 2
    assert most * runner.layout.num_layers <= len(PROMPTS) * (GLOBAL_BLOCKS + SLIDING_PEAK) * half, most
    if offload != "none":
        assert seen["cpu_decodes"] > 0, seen
    assert_all_blocks_free(llm.engine)
    llm.shutdown()


@pytest.mark.parametrize("tier", ["device", "host"])
def test_a_hybrid_models_prefix_hits_take_every_groups_blocks(checkpoints, tier: str) -> None:  # noqa: ANN001
    # Prompts of 40 tokens sharing their first 32, one after the other, each followed by one of
    # 80 tokens of its own whose blocks take cached ones: later prompts find the first four
    # blocks of tokens in the device cache (a pool of 64) or, a pool of 32 having evicted them,
    # in the host tier, and still match transformers. The sliding group's blocks behind the
    # window of the prompt's next token are neither needed nor copied back: a host hit copies
    # the global group's four blocks and the sliding group's last.
    shared = list(range(40, 72))
    prompts = [shared + [200 + i] * 8 for i in range(3)]
    path = checkpoints["gemma3"]
    device_blocks = 64 if tier == "device" else 32
    pools = dict(num_gpu_blocks=device_blocks, num_cpu_blocks=128, cpu_prefix_cache_gib=1)
    with LLM(str(path), dtype="float32", block_size=BLOCK, **pools) as llm:
        params = SamplingParams(temperature=0, max_tokens=NEW, ignore_eos=True)
        tokens = []
        for i, p in enumerate(prompts):
            tokens.append(llm.generate([p], params, use_tqdm=False)[0].outputs[0].token_ids)
            llm.generate([[250 + i] * 80], SamplingParams(max_tokens=8), use_tqdm=False)
        st = llm.engine.scheduler.stats()
        assert_all_blocks_free(llm.engine)
    assert tokens == _hf(path, prompts)
    if tier == "device":
        assert (st["prefix_cache_hits"], st["prefix_cache_host_hits"]) == (2 * len(shared), 0), st
    else:
        host_hits = st["prefix_cache_host_hits"] // len(shared)
        assert host_hits > 0 and st["num_cache_blocks_to_device"] == host_hits * (4 + 1), st


@pytest.mark.parametrize("backend", ["triton", "torch"])
def test_the_cuda_path_reads_only_the_window(monkeypatch, sliding, backend: str) -> None:  # noqa: ANN001
    # Each iteration within the sync budget, no device mixed up, and every block back.
    with fake_gpu(monkeypatch, backend) as checks:
        engine = engine_on(
            str(sliding), offload="neo", num_gpu_blocks=5, max_num_batched_tokens=24, neo_force_pipeline=True
        )
        for p in PROMPTS:
            engine.add_request(p, SamplingParams(temperature=0, max_tokens=NEW, ignore_eos=True))
        assert "pipelined" in run(engine, checks)
        assert_all_blocks_free(engine)
        engine.shutdown()
