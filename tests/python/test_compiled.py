"""The decoder stack compiled by Inductor (``worker/compiled.py``), on tiny checkpoints in fp32:
greedy tokens identical to transformers in every dense family (sliding windows, soft-caps, two
RoPE tables, layers without RoPE, q/k norms), also under preemption and in every offload mode;
iterations over the device pool alone (prompts and decodes) run compiled, in at most two graphs;
what cannot compile runs eager; Inductor's cache sits in our folder."""

from __future__ import annotations

import gc
import os
import subprocess
import sys
import weakref

import pytest
import torch
from conftest import ARCHS, FAMILIES, assert_all_blocks_free
from neo_rs import LLM, SamplingParams
from neo_rs.worker import compiled as compiled_module
from neo_rs.worker.compiled import MAX_GRAPHS, _Inductor
from test_model_parity import GREEDY, MODES, PROMPTS, hf_greedy, run
from test_speculation import NGRAM
from test_speculation import PROMPTS as REPEATING

DENSE = [k for k in ARCHS + FAMILIES if k not in ("mixtral", "qwen3_moe")]


@pytest.mark.parametrize("kind", DENSE)
def test_compiled_greedy_matches_transformers(checkpoints, kind: str) -> None:
    tokens, engine, _ = run(checkpoints[kind], num_gpu_blocks=64, enforce_eager=False)
    assert tokens == [hf_greedy(checkpoints[kind], kind, p) for p in PROMPTS]
    compiled = engine.runner.compiled
    assert compiled is not None and compiled.graphs == MAX_GRAPHS, "both graphs, at start-up"
    assert compiled.runs > 0
    assert_all_blocks_free(engine)


@pytest.mark.parametrize("offload", list(MODES))
def test_compiled_with_preemption_and_offload_keeps_tokens(checkpoints, offload: str) -> None:
    # Every iteration runs compiled: its swaps, host prefills and CPU decodes (NEO's hand-off) in
    # the attention op; NEO's pipelined sub-batches (every CPU decode under the forced pipeline)
    # one after the other, as the kernel runs on the model's OpenMP team.
    tokens, engine, seen = run(checkpoints["qwen2"], offload=offload, enforce_eager=False, **MODES[offload])
    assert tokens == [hf_greedy(checkpoints["qwen2"], "qwen2", p) for p in PROMPTS]
    runs = seen["gpu-only"] + seen["sequential"] + 2 * seen["pipelined"]
    assert engine.runner.compiled.runs == runs > 0, seen
    assert (seen["sequential"] > 0) == (offload == "all"), seen
    assert (seen["pipelined"] > 0) == (offload == "neo"), seen
    assert (seen["cpu_decodes"] > 0) == (offload != "none"), seen
    assert engine.runner.compiled.graphs == MAX_GRAPHS
    assert_all_blocks_free(engine)


def test_pipelined_sub_batches_stay_eager_beside_the_kernel_s_own_threads(checkpoints, monkeypatch) -> None:
    # Where the CPU attention runs on the kernel's own pool, NEO's pipeline overlaps it with the
    # other sub-batch's layers: the layers interleave, op by op.
    monkeypatch.setenv("NEO_RS_OPENMP_TEAM", "0")
    tokens, engine, seen = run(checkpoints["qwen2"], offload="neo", enforce_eager=False, **MODES["neo"])
    assert tokens == [hf_greedy(checkpoints["qwen2"], "qwen2", p) for p in PROMPTS]
    assert seen["pipelined"] > 0, seen
    assert engine.runner.compiled.runs == seen["gpu-only"] + seen["sequential"], seen
    assert_all_blocks_free(engine)


def test_prompts_and_decodes_run_compiled_in_two_graphs(checkpoints) -> None:
    llm = LLM(str(checkpoints["llama"]), dtype="float32", enforce_eager=False)
    compiled = llm.engine.runner.compiled
    out = llm.generate([PROMPTS[1]], SamplingParams(temperature=0, max_tokens=5, ignore_eos=True))
    assert len(out[0].outputs[0].token_ids) == 5
    assert compiled.runs == 5, "the prompt's iteration and its four decodes"
    # Every batch size from 1 to 6 rows, with prompts joining mid-run: no graph more.
    llm.generate(PROMPTS, GREEDY)
    assert compiled.graphs == MAX_GRAPHS
    # Those iterations checked only the guard between the two graphs; hidden states unlike the
    # warm-up's would check them all.
    hidden = compiled.model.config.hidden_size
    assert compiled.serves(torch.zeros(1, hidden)) and compiled.serves(torch.zeros(6, hidden))
    assert not compiled.serves(torch.zeros(0, hidden))
    assert not compiled.serves(torch.zeros(3, hidden, dtype=torch.bfloat16))


def test_the_layers_float_attributes_are_constants_of_the_graphs(checkpoints, monkeypatch, tmp_path) -> None:
    """RMSNorm's eps enters the graphs specialized: Dynamo would otherwise take each float
    attribute as a 0-dim tensor input, built anew on every call."""
    monkeypatch.setattr(compiled_module, "_saved_graphs", lambda: tmp_path)  # traced, not loaded
    seen: list[list[object]] = []
    count = _Inductor.__call__

    def spy(self: _Inductor, gm: torch.fx.GraphModule, inputs: list[object]) -> object:
        seen.append(inputs)
        return count(self, gm, inputs)

    monkeypatch.setattr(_Inductor, "__call__", spy)
    llm = LLM(str(checkpoints["llama"]), dtype="float32", enforce_eager=False)
    assert len(seen) == MAX_GRAPHS
    assert not [x for inputs in seen for x in inputs if isinstance(x, torch.Tensor) and x.dim() == 0]
    llm.shutdown()


def test_a_shut_down_engine_frees_its_compiled_model(checkpoints) -> None:
    # Dynamo keeps its backend as long as the code it compiled, where the garbage collector does
    # not look: a backend holding the stack kept every compiled model and its pools alive.
    llm = LLM(str(checkpoints["llama"]), dtype="float32", enforce_eager=False)
    runner = llm.engine.runner
    assert runner.compiled is not None
    held = (runner, runner.compiled, runner.model, runner.device_pool, runner.host_pool)
    refs = [weakref.ref(x) for x in held]
    del held
    llm.shutdown()
    del llm, runner
    gc.collect()
    assert [r() for r in refs] == [None] * len(refs)


def test_sparse_models_and_enforce_eager_run_eager(checkpoints, monkeypatch) -> None:
    llm = LLM(str(checkpoints["mixtral"]), dtype="float32", enforce_eager=False)
    assert llm.engine.runner.compiled is None
    assert LLM(str(checkpoints["llama"]), dtype="float32", enforce_eager=True).engine.runner.compiled is None
    # Unset, the environment decides (the suite's conftest sets NEO_RS_ENFORCE_EAGER=1).
    monkeypatch.setenv("NEO_RS_ENFORCE_EAGER", "0")
    assert LLM(str(checkpoints["llama"]), dtype="float32").engine.runner.compiled is not None


def test_a_failed_compile_leaves_the_engine_eager(checkpoints, monkeypatch, caplog, tmp_path) -> None:
    import torch._inductor.compile_fx

    monkeypatch.setattr(compiled_module, "_saved_graphs", lambda: tmp_path)  # nothing to load

    def no_compiler(*args: object, **kwargs: object) -> None:
        raise RuntimeError("no C++ compiler")

    monkeypatch.setattr(torch._inductor.compile_fx, "compile_fx", no_compiler)
    tokens, engine, _ = run(checkpoints["llama"], num_gpu_blocks=64, enforce_eager=False)
    assert engine.runner.compiled is None
    assert "no C++ compiler" in caplog.text
    assert tokens == [hf_greedy(checkpoints["llama"], "llama", p) for p in PROMPTS]


def test_a_later_engine_loads_the_saved_graphs(checkpoints, monkeypatch, caplog, tmp_path) -> None:
    # Each graph is compiled ahead of time and saved; a later start (another engine here) loads
    # both instead of tracing them. Files that do not load are compiled and saved anew.
    monkeypatch.setattr(compiled_module, "_saved_graphs", lambda: tmp_path)
    want = [hf_greedy(checkpoints["qwen2"], "qwen2", p) for p in PROMPTS]
    built = []
    for corrupt in (False, False, True):
        if corrupt:
            for saved in tmp_path.iterdir():
                saved.write_bytes(b"not a graph")
        tokens, engine, _ = run(checkpoints["qwen2"], num_gpu_blocks=64, enforce_eager=False)
        assert tokens == want
        compiled = engine.runner.compiled
        assert compiled.runs > 0
        built.append((compiled._inductor.graphs, compiled.loaded))
        engine.shutdown()
    assert built == [(MAX_GRAPHS, 0), (0, MAX_GRAPHS), (MAX_GRAPHS, 0)]
    assert "could not load the saved decoder stack" in caplog.text
    assert len(list(tmp_path.iterdir())) == MAX_GRAPHS


def test_without_aot_compile_the_graphs_trace_at_start_up(checkpoints, monkeypatch) -> None:
    # A torch whose compiled functions have no ``aot_compile``: both graphs are traced by the
    # warm-up, nothing is saved or loaded, and the tokens are transformers'.
    compile_ = torch.compile

    def without_aot(fn: object, **kwargs: object) -> object:
        compiled = compile_(fn, **kwargs)
        return lambda *args: compiled(*args)

    monkeypatch.setattr(torch, "compile", without_aot)
    tokens, engine, _ = run(checkpoints["llama"], num_gpu_blocks=64, enforce_eager=False)
    assert tokens == [hf_greedy(checkpoints["llama"], "llama", p) for p in PROMPTS]
    compiled = engine.runner.compiled
    assert (compiled._inductor.graphs, compiled.loaded) == (MAX_GRAPHS, 0)
    assert compiled.runs > 0
    engine.shutdown()


def test_saved_graphs_are_named_by_what_their_code_depends_on(checkpoints) -> None:
    names = set()
    for kwargs in ({"dtype": "float32"}, {"dtype": "bfloat16"}, {"dtype": "float32", "quantization": "int8"}):
        llm = LLM(str(checkpoints["llama"]), enforce_eager=True, **kwargs)
        model = llm.engine.runner.model
        names |= {compiled_module._graph_name(model, rows) for rows in (1, 2)}
        model.decoder_layers[-1].input_layernorm.eps *= 2  # a constant of the graph
        names.add(compiled_module._graph_name(model, 2))
        llm.shutdown()
    assert len(names) == 9


@pytest.mark.parametrize("quantization", ["int8", "int4"])
def test_compiled_quantized_linears_keep_eager_tokens(checkpoints, quantization: str) -> None:
    tokens = {}
    for eager in (True, False):
        got, engine, _ = run(checkpoints["llama"], quantization=quantization, enforce_eager=eager)
        assert (engine.runner.compiled is None) == eager
        assert eager or engine.runner.compiled.runs > 0
        kinds = {type(m).__name__ for m in engine.runner.model.modules()}
        assert f"{quantization.capitalize()}Linear" in kinds
        tokens[eager] = got
    assert tokens[True] == tokens[False]


@pytest.mark.parametrize("quantization", ["int8", "int4"])
def test_our_quantized_kernels_compile_and_save_in_bfloat16(
    checkpoints, monkeypatch, tmp_path, quantization: str
) -> None:
    # In bf16 on the CPU the quantized linears run our Rust kernel (``QuantGemm``), which does not
    # pickle: the trace must not read it, or saving the graphs' guards fails and the engine runs
    # eager (``make serve``'s GGUF blocks did).
    monkeypatch.setattr(compiled_module, "_saved_graphs", lambda: tmp_path)
    llm = LLM(str(checkpoints["llama"]), dtype="bfloat16", quantization=quantization, enforce_eager=False)
    compiled = llm.engine.runner.compiled
    assert compiled is not None and compiled.graphs == MAX_GRAPHS
    assert any(getattr(m, "gemm", None) is not None for m in compiled.model.modules())
    out = llm.generate(PROMPTS, GREEDY, use_tqdm=False)
    assert all(len(o.outputs[0].token_ids) == GREEDY.max_tokens for o in out)
    assert compiled.runs > 0 and len(list(tmp_path.iterdir())) == MAX_GRAPHS
    llm.shutdown()


def test_inductor_caches_under_our_folder(tmp_path) -> None:
    """Set on import, before torch._dynamo fixes the folder; a folder the user set is kept."""
    code = "import os, neo_rs, torch._dynamo; print(os.environ['TORCHINDUCTOR_CACHE_DIR'])"
    env = {k: v for k, v in os.environ.items() if k != "TORCHINDUCTOR_CACHE_DIR"}
    env["NEO_RS_CACHE_DIR"] = str(tmp_path)
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
    assert out.stdout.strip() == str(tmp_path / "inductor")
    env["TORCHINDUCTOR_CACHE_DIR"] = str(tmp_path / "theirs")
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
    assert out.stdout.strip() == str(tmp_path / "theirs")


def test_the_attention_op_keeps_its_fake_shapes(checkpoints) -> None:
    """Inductor's run-time checks of op outputs are off: opcheck holds ``neo_rs::layer_attention``'s
    fake implementation to the real one instead (a prompt of three rows in a fresh pool)."""
    from neo_rs.attention.metadata import AttentionBatch
    from neo_rs.timing import HostWaits, StageClock

    llm = LLM(str(checkpoints["llama"]), dtype="float32", enforce_eager=False)
    runner = llm.engine.runner
    cfg = runner.model.config
    llm.engine.add_request([1, 2, 3], SamplingParams(max_tokens=1))
    plan = llm.engine.scheduler.schedule()  # one prompt's, as the engine plans it
    batch = AttentionBatch.from_plan(plan, runner.transfer, runner.layout.block_size)[0]
    assert batch.prefills and batch.device_writes
    clock = StageClock(torch.device("cpu"), HostWaits(), timed=False)
    compiled_module._current.step = compiled_module._Step(runner.attend, batch, None, clock)
    try:
        q = torch.randn(3, cfg.num_heads, cfg.head_dim)
        k, v = (torch.randn(3, cfg.num_kv_heads, cfg.head_dim) for _ in range(2))
        torch.library.opcheck(torch.ops.neo_rs.layer_attention.default, (q, k, v, 0))
    finally:
        compiled_module._current.step = None
        llm.shutdown()


def test_decodes_verifying_drafts_run_compiled(checkpoints, monkeypatch) -> None:
    # On a CPU device, each row of a decode verifying drafts attends as a decode at its own
    # position (``attention/metadata.py``): such steps run compiled too, tokens unchanged.
    monkeypatch.setenv("NEO_RS_FORCE_SPECULATION", "1")
    path = str(checkpoints["llama3"])
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    with LLM(path, dtype="float32") as llm:
        want = [o.outputs[0].token_ids for o in llm.generate(REPEATING, params, use_tqdm=False)]
    llm = LLM(path, dtype="float32", speculative_config=NGRAM, enforce_eager=False)
    engine, compiled = llm.engine, llm.engine.runner.compiled
    step, verifying = engine.step, []

    def watched() -> list:
        runs = compiled.runs
        outs = step()
        if engine.last_stats is not None and engine.last_stats.num_draft_tokens:
            verifying.append(compiled.runs - runs)
        return outs

    engine.step = watched  # type: ignore[method-assign]
    with llm:
        got = [o.outputs[0].token_ids for o in llm.generate(REPEATING, params, use_tqdm=False)]
        assert_all_blocks_free(engine)
    assert got == want
    assert verifying and all(n == 1 for n in verifying), verifying
    assert compiled.graphs == MAX_GRAPHS
