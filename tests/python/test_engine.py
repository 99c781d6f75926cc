"""The engine around the model: loading errors name what is wrong, aborts free every block,
the torch decode fallback agrees with the Rust kernel, reduced dtypes track transformers, chat
templates, incremental detokenization and the demo model."""

from __future__ import annotations

import dataclasses
import json
import shutil

import pytest
import torch
from conftest import assert_all_blocks_free
from neo_rs import LLM, LLMEngine, ModelLoadError, RequestOutputKind, SamplingParams
from neo_rs.attention.device_decode import TorchDecode
from neo_rs.attention.metadata import AttentionBatch
from neo_rs.config import EngineArgs
from neo_rs.engine.tokenizer import MAX_PENDING_TOKENS, IncrementalDetokenizer, load_tokenizer
from neo_rs.errors import InvalidArgumentError
from neo_rs.model.demo import demo_model_dir


def test_load_errors_name_the_problem(checkpoints, tmp_path) -> None:
    with pytest.raises(ModelLoadError, match="no config.json"):
        LLM(str(tmp_path))
    bad = tmp_path / "gpt2"
    shutil.copytree(checkpoints["llama"], bad)
    cfg = json.loads((bad / "config.json").read_text())
    (bad / "config.json").write_text(json.dumps(cfg | {"architectures": ["GPT2LMHeadModel"]}))
    with pytest.raises(ModelLoadError, match="unsupported architecture 'GPT2LMHeadModel'"):
        LLM(str(bad))
    (bad / "config.json").write_text(
        json.dumps(cfg | {"rope_parameters": {"rope_type": "yarn", "factor": 2.0}})
    )
    with pytest.raises(ModelLoadError, match="rope scaling type 'yarn'"):
        LLM(str(bad))
    (bad / "config.json").write_text(json.dumps(cfg))
    (bad / "model.safetensors").unlink()
    with pytest.raises(ModelLoadError, match="no model.safetensors"):
        LLM(str(bad))
    from safetensors.torch import load_file, save_file

    weights = load_file(checkpoints["llama"] / "model.safetensors")
    del weights["model.layers.1.mlp.up_proj.weight"]
    save_file(weights, bad / "model.safetensors")
    with pytest.raises(ModelLoadError, match="layers.1.mlp.gate_up_proj.weight"):
        LLM(str(bad))
    sharded = tmp_path / "sharded"
    shutil.copytree(checkpoints["llama-sharded"], sharded)
    next(sharded.glob("model-00002-*.safetensors")).unlink()
    with pytest.raises(ModelLoadError, match="missing: model-00002"):
        LLM(str(sharded))


def test_abort_frees_blocks_in_both_pools(checkpoints) -> None:
    engine = LLMEngine(
        EngineArgs(
            model=str(checkpoints["llama"]),
            dtype="float32",
            num_gpu_blocks=6,
            block_size=8,
            num_cpu_blocks=32,
        )
    )
    p = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True)
    ids = [engine.add_request(list(range(1, 12)), p) for _ in range(4)]
    s = engine.scheduler
    for _ in range(40):
        engine.step()
        if s.num_swapped:
            break
    assert s.num_swapped > 0 and s.num_free_blocks("cpu") < s.num_total_blocks("cpu")
    for rid in ids:
        out = engine.abort(rid)
        assert out is not None and out.finished and out.outputs[0].finish_reason == "abort"
    assert engine.abort(ids[0]) is None
    assert_all_blocks_free(engine)


def test_torch_decode_fallback_matches_the_rust_kernel(checkpoints) -> None:
    engine = LLMEngine(
        EngineArgs(model=str(checkpoints["llama3"]), dtype="float32", num_gpu_blocks=64, block_size=8)
    )
    for n in (5, 17, 30):
        engine.add_request(
            list(range(1, n + 1)), SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
        )
    engine.step()  # prefills
    plan = engine.scheduler.schedule()
    assert plan.num_decodes == 3
    runner = engine.runner
    (batch,) = AttentionBatch.from_plan(plan, runner.transfer, runner.layout.block_size)
    layout = runner.layout
    q = torch.randn(3, 4, layout.head_dim, device=runner.device)
    want = torch.empty_like(q)
    # Attend over the prompts only, with every later slot of their blocks poisoned: pools are
    # never cleared, so such slots hold whatever the memory held (inf and NaN included).
    rows = dataclasses.replace(batch.gpu_decodes, seq_lens=batch.gpu_decodes.seq_lens - 1)
    bs = layout.block_size
    for table, n in zip(rows.block_tables.tolist(), rows.seq_lens.tolist(), strict=True):
        for pos in range(n, -(-n // bs) * bs):
            runner.device_pool.k[1][table[pos // bs], :, pos % bs] = float("nan")
            runner.device_pool.v[1][table[pos // bs], :, pos % bs] = float("inf")
    runner.attention.decode(q, runner.device_pool, 1, rows, want)
    got = torch.empty_like(q)
    TorchDecode()(q, runner.device_pool, 1, rows, runner.attention.kinds[1], got)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    engine.scheduler.update([0, 0, 0], [])
    for rid in list(engine._requests):
        engine.abort(rid)
    assert_all_blocks_free(engine)


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_reduced_dtypes_track_transformers(checkpoints, dtype: str) -> None:
    from transformers import AutoModelForCausalLM

    engine = LLMEngine(EngineArgs(model=str(checkpoints["qwen2"]), dtype=dtype, num_gpu_blocks=64))
    prompt = list(range(20, 60))
    rid = engine.add_request(prompt, SamplingParams(max_tokens=1))
    ours = engine.runner.execute(engine.scheduler.schedule())[0].cpu()
    engine.scheduler.update([0], [])
    engine.abort(rid)
    hf = AutoModelForCausalLM.from_pretrained(checkpoints["qwen2"], dtype=getattr(torch, dtype)).eval()
    with torch.no_grad():
        want = hf(torch.tensor([prompt])).logits[0, -1].float()
    assert (ours - want).abs().max() < 0.05 * want.abs().max()
    assert_all_blocks_free(engine)


def test_chat_uses_the_template(checkpoints) -> None:
    llm = LLM(str(checkpoints["mistral"]), dtype="float32", num_gpu_blocks=64)
    conv = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi!"}]
    out = llm.chat(conv, SamplingParams(temperature=0, max_tokens=4, ignore_eos=True), use_tqdm=False)[0]
    tok = llm.get_tokenizer()
    assert out.prompt == "<s><|system|>\nBe brief.\n<|user|>\nHi!\n<|assistant|>\n"
    assert out.prompt_token_ids == tok.encode(out.prompt, add_special_tokens=False)
    assert out.prompt_token_ids[0] == 256 and len(out.outputs[0].token_ids) == 4
    tool = {"type": "function", "function": {"name": "now", "parameters": {"type": "object"}}}
    with_tools = llm.chat(conv, SamplingParams(max_tokens=1), use_tqdm=False, tools=[tool])[0]
    assert with_tools.prompt.startswith(
        '<s><|system|>\n<tools>[{"type": "function", "function": {"name": "now"'
    )
    assert_all_blocks_free(llm.engine)


class _PythonTokenizer:
    """A tokenizer without a ``tokenizers`` backend (transformers' Python and SentencePiece ones):
    the detokenizer's Python stream decodes it."""

    def __init__(self, tok) -> None:
        self.tok = tok

    def decode(self, ids: list[int], skip_special_tokens: bool) -> str:
        return self.tok.decode(ids, skip_special_tokens=skip_special_tokens)


@pytest.fixture(params=["DecodeStream", "python"])
def demo_tokenizer(request):
    tok = load_tokenizer(demo_model_dir())
    return tok if request.param == "DecodeStream" else _PythonTokenizer(tok)


def test_incremental_detokenizer_never_splits_a_character(demo_tokenizer) -> None:
    text = "héllo wörld — 日本語 🙂 ok"
    ids = load_tokenizer(demo_model_dir()).encode(text, add_special_tokens=False)
    assert len(ids) > len(text)  # multi-byte characters span several tokens
    detok = IncrementalDetokenizer(demo_tokenizer, [256], skip_special_tokens=True)
    deltas = [detok.add(t) for t in ids]
    assert "".join(deltas) == text
    assert not any("\ufffd" in d for d in deltas)
    assert deltas.count("") == len(ids) - len(text)  # each character's bytes but its last held


def test_incremental_detokenizer_holds_back_a_bounded_run_of_invalid_bytes(demo_tokenizer) -> None:
    detok = IncrementalDetokenizer(demo_tokenizer, [256], skip_special_tokens=True)
    # 0xFF never starts a UTF-8 character: waiting for one to complete would never end.
    deltas = [detok.add(0xFF) for _ in range(1000)]
    assert deltas[MAX_PENDING_TOKENS - 1] == "\ufffd" * MAX_PENDING_TOKENS
    assert "".join(deltas) == "\ufffd" * (1000 // MAX_PENDING_TOKENS * MAX_PENDING_TOKENS)
    # A valid character comes out at once, after the invalid bytes still held back.
    assert detok.add(ord("a")) == "\ufffd" * (1000 % MAX_PENDING_TOKENS) + "a"


def test_incremental_detokenizer_goes_on_where_the_stream_fails() -> None:
    from tokenizers import Tokenizer, decoders, models
    from transformers import PreTrainedTokenizerFast

    # A decoder whose text shrinks as a token arrives ("a", then "ab" decodes to "X"), which
    # tokenizers' DecodeStream refuses ("Invalid prefix") from then on.
    raw = Tokenizer(models.WordLevel({"a": 0, "b": 1, "c": 2, "d": 3}, unk_token="a"))
    raw.decoder = decoders.Sequence([decoders.Fuse(), decoders.Replace("ab", "X")])
    tok = PreTrainedTokenizerFast(tokenizer_object=raw)
    for t in (tok, _PythonTokenizer(tok)):
        detok = IncrementalDetokenizer(t, [], skip_special_tokens=False)
        # "b" adds no text; "c" gives the text after the window's old one; the stream starts
        # again after it, and "d" comes out on its own.
        assert [detok.add(i) for i in (0, 1, 2, 3)] == ["a", "", "c", "d"]


def test_incremental_detokenizer_cleans_up_spaces_where_the_tokenizer_asks() -> None:
    from tokenizers import Tokenizer, models
    from transformers import PreTrainedTokenizerFast

    # transformers' decode takes out the spaces before punctuation that the words' join put there.
    raw = Tokenizer(models.WordLevel({"hello": 0, ",": 1, "world": 2, ".": 3}, unk_token="hello"))
    tok = PreTrainedTokenizerFast(tokenizer_object=raw, clean_up_tokenization_spaces=True)
    assert tok.decode([0, 1, 2, 3]) == "hello, world."
    detok = IncrementalDetokenizer(tok, [0], skip_special_tokens=False)
    assert [detok.add(i) for i in (1, 2, 3)] == [",", " world", "."]


def test_demo_model_runs_and_says_its_weights_are_random(caplog) -> None:
    with caplog.at_level("WARNING"):
        llm = LLM(None, num_gpu_blocks=32)
    assert "RANDOM" in caplog.text
    cfg = json.loads((demo_model_dir() / "config.json").read_text())
    assert cfg["architectures"] == ["LlamaForCausalLM"] and cfg["num_key_value_heads"] == 2
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    a = llm.generate("Hi", params, use_tqdm=False)
    step, stepped = llm.engine.step, []
    llm.engine.step = lambda: stepped.append(step()) or stepped[-1]  # type: ignore[method-assign]
    b = llm.generate(["Hi", "Hello"], params, use_tqdm=False)[0]
    assert a[0].outputs[0].token_ids == b.outputs[0].token_ids and len(a[0].outputs[0].token_ids) == 8
    # generate builds each request's output once, when it finishes, and leaves the params alone.
    assert [len(outs) for outs in stepped] == [0] * 7 + [2]  # both prompts' first tokens in one step
    assert all(out.finished for out in stepped[-1])
    assert params.output_kind is RequestOutputKind.CUMULATIVE
    assert_all_blocks_free(llm.engine)


@pytest.mark.parametrize(("offload", "pool"), [("none", "device"), ("neo", "host")])
def test_a_request_larger_than_a_pool_is_refused_before_it_is_queued(offload: str, pool: str) -> None:
    """Found by benches/soak.py: the scheduler refused it on the engine's thread, and the server
    answered 500; the engine now says so when the request is checked, and the server 400."""
    blocks = {
        "device": dict(num_gpu_blocks=4, num_cpu_blocks=64),
        "host": dict(num_gpu_blocks=64, num_cpu_blocks=4),
    }
    engine = LLMEngine(EngineArgs(model="demo", offload=offload, block_size=8, **blocks[pool]))
    with pytest.raises(InvalidArgumentError, match=f"the {pool} pool has 4"):
        engine.check_prompt(list(range(3, 23)), SamplingParams(max_tokens=20))  # what a server asks first
    assert engine.check_prompt(list(range(3, 23)), SamplingParams(max_tokens=12)) == 12  # 31 tokens: 4 blocks
    engine.shutdown()
