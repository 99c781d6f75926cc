"""Tensor parallelism on 2 gloo ranks (this machine's 2 cores): each rank's weights checked
against the full checkpoint's slices; greedy parity with one rank and with transformers in every
offload mode, with a device pool small enough that swaps and CPU decodes happen, on a model whose
one KV head every rank replicates and one whose two KV heads the ranks split; a rank that dies or
raises stops the engine with a clear error and leaves no process behind; the server with
``--tensor-parallel-size 2``."""

from __future__ import annotations

import os
import signal
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest
import torch
from conftest import assert_all_blocks_free, hf_greedy_ids
from neo_rs import LLM, EngineDeadError, InvalidArgumentError, SamplingParams
from neo_rs.config import ModelConfig
from neo_rs.model.loader import load_model
from neo_rs.parallel.group import TensorParallel
from neo_rs.parallel.shards import TpShard
from server_util import Server

# mistral: 4 heads, 1 KV head (each rank replicates it); qwen2: 4 heads, 2 KV heads (one per rank),
# QKV bias and tied embeddings.
KINDS = ["mistral", "qwen2"]
PROMPTS = [[1 + i, 5, 9, 17 + i, 3] * (3 + i) for i in range(5)]
GREEDY = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
# 12 blocks of 8 tokens hold 3 of the 5 requests: the rest are swapped or decode on the CPU.
SMALL_POOL = dict(
    dtype="float32", block_size=8, num_gpu_blocks=12, num_cpu_blocks=64, enable_prefix_caching=False
)
_hf: dict[str, list[list[int]]] = {}


def hf_tokens(path: Path, kind: str) -> list[list[int]]:
    if kind not in _hf:
        from transformers import AutoModelForCausalLM

        model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
        _hf[kind] = [hf_greedy_ids(model, p, GREEDY.max_tokens or 0) for p in PROMPTS]
    return _hf[kind]


def generate(path: Path, tp: int, offload: str, **pool: int) -> tuple[list[list[int]], dict[str, int]]:
    """Greedy tokens and the scheduler's stats; ``pool`` overrides ``SMALL_POOL``'s sizes."""
    llm = LLM(
        str(path), tensor_parallel_size=tp, offload=offload, neo_force_pipeline=True, **{**SMALL_POOL, **pool}
    )
    try:
        outs = llm.generate(PROMPTS, GREEDY, use_tqdm=False)
        assert_all_blocks_free(llm.engine)
        return [o.outputs[0].token_ids for o in outs], llm.engine.scheduler.stats()
    finally:
        llm.engine.shutdown()


def worker_procs(llm: LLM) -> list:  # noqa: ANN201 (multiprocessing processes)
    assert llm.engine.workers is not None
    return llm.engine.workers.procs


# -- sharding -----------------------------------------------------------------------------------


def _cfg(
    heads: int, kv_heads: int, vocab: int = 300, intermediate: int = 128, **extra: object
) -> ModelConfig:
    return ModelConfig.from_hf(
        {
            "architectures": ["LlamaForCausalLM"],
            "vocab_size": vocab,
            "hidden_size": 64,
            "intermediate_size": intermediate,
            "num_hidden_layers": 1,
            "num_attention_heads": heads,
            "num_key_value_heads": kv_heads,
            **extra,
        }
    )


_MOE = dict(architectures=["Qwen3MoeForCausalLM"], num_experts=4, num_experts_per_tok=2)


def test_shards_split_heads_and_replicate_kv_heads() -> None:
    # Fewer KV heads than ranks: consecutive ranks share one, and its query heads are theirs.
    cfg = _cfg(heads=8, kv_heads=2)
    shards = [TpShard(r, 4) for r in range(4)]
    assert [list(s.kv_heads(cfg)) for s in shards] == [[0], [0], [1], [1]]
    group = cfg.num_heads // cfg.num_kv_heads
    for s in shards:
        assert {h // group for h in s.heads(cfg)} == set(s.kv_heads(cfg))
    # Enough KV heads: split like the query heads.
    assert [list(TpShard(r, 2).kv_heads(cfg)) for r in range(2)] == [[0], [1]]
    # The vocabulary splits into equal padded parts; the last holds the remainder.
    assert [TpShard(r, 4).vocab(_cfg(8, 2, vocab=301)) for r in range(4)] == [
        range(0, 76),
        range(76, 152),
        range(152, 228),
        range(228, 301),
    ]
    local = TpShard(1, 2).local_config(cfg)
    assert (local.num_heads, local.num_kv_heads, local.intermediate_size, local.vocab_size) == (4, 1, 64, 150)


def test_experts_split_their_intermediate_columns() -> None:
    cfg = _cfg(heads=8, kv_heads=8, moe_intermediate_size=32, **_MOE)
    assert [TpShard(r, 2).moe_ffn(cfg) for r in range(2)] == [range(0, 16), range(16, 32)]
    local = TpShard(1, 2).local_config(cfg)
    assert local.moe is not None and local.moe.intermediate_size == 16 and local.moe.num_experts == 4


@pytest.mark.parametrize(
    ("cfg", "size", "what"),
    [
        (_cfg(heads=9, kv_heads=3), 2, "attention heads"),
        (_cfg(heads=8, kv_heads=3), 2, "KV heads"),
        (_cfg(heads=12, kv_heads=6), 4, "KV heads"),
        (_cfg(heads=8, kv_heads=8, intermediate=100), 8, "intermediate size"),
        (_cfg(heads=8, kv_heads=8, moe_intermediate_size=36, **_MOE), 8, "experts' intermediate size"),
        (
            _cfg(heads=8, kv_heads=8, architectures=["Olmo2ForCausalLM"]),
            2,
            "does not support tensor parallelism",
        ),
    ],
)
def test_indivisible_shapes_are_refused(cfg: ModelConfig, size: int, what: str) -> None:
    with pytest.raises(InvalidArgumentError, match=what):
        TpShard(0, size).check(cfg)


def test_an_indivisible_model_is_refused_before_any_worker_starts(checkpoints) -> None:  # noqa: ANN001
    # 4 heads do not split over 3 ranks: the error comes from the engine, at once.
    with pytest.raises(InvalidArgumentError, match="tensor_parallel_size 3"):
        LLM(str(checkpoints["llama"]), tensor_parallel_size=3)


def _count_reads(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """Elements each checkpoint read returns (``load_model``'s ``safe_open``, wrapped)."""
    import neo_rs.model.loader as loader

    read: list[int] = []
    opened = loader.safe_open

    class Slice:
        def __init__(self, inner) -> None:  # noqa: ANN001
            self.inner = inner

        def get_shape(self) -> list[int]:
            return self.inner.get_shape()

        def __getitem__(self, index):  # noqa: ANN001, ANN204
            t = self.inner[index]
            read.append(t.numel())
            return t

    class File:
        def __init__(self, *args, **kwargs) -> None:  # noqa: ANN002, ANN003
            self.inner = opened(*args, **kwargs)

        def __enter__(self) -> File:
            self.f = self.inner.__enter__()
            return self

        def __exit__(self, *exc) -> None:  # noqa: ANN002
            self.inner.__exit__(*exc)

        def keys(self) -> list[str]:
            return list(self.f.keys())

        def get_slice(self, name: str) -> Slice:
            return Slice(self.f.get_slice(name))

    monkeypatch.setattr(loader, "safe_open", File)
    return read


@pytest.mark.parametrize("kind", ["mistral", "qwen2", "llama3"])
def test_each_rank_loads_its_slices_of_the_checkpoint(checkpoints, monkeypatch, kind: str) -> None:  # noqa: ANN001
    from transformers import AutoModelForCausalLM

    path = checkpoints[kind]
    cfg = ModelConfig.from_dir(path)
    full = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).state_dict()
    d = cfg.head_dim
    read = _count_reads(monkeypatch)
    for rank in range(2):
        shard = TpShard(rank, 2)
        read.clear()
        model = load_model(path, cfg, torch.float32, torch.device("cpu"), 64, TensorParallel(shard))
        # Only what the rank holds was read from the checkpoint, never a whole tensor to cut.
        assert sum(read) == sum(p.numel() for p in model.parameters())
        mine = model.state_dict()
        heads, kv, ffn, vocab = shard.heads(cfg), shard.kv_heads(cfg), shard.ffn(cfg), shard.vocab(cfg)

        def rows(name: str, r: range, scale: int = 1) -> torch.Tensor:
            return full[name][r.start * scale : r.stop * scale]

        attn, mlp = "model.layers.1.self_attn", "model.layers.1.mlp"
        qkv = torch.cat([rows(f"{attn}.q_proj.weight", heads, d), rows(f"{attn}.k_proj.weight", kv, d)])
        qkv = torch.cat([qkv, rows(f"{attn}.v_proj.weight", kv, d)])
        assert torch.equal(mine["layers.1.qkv_proj.weight"], qkv)
        if cfg.qkv_bias:
            parts = [(f"{attn}.{x}_proj.bias", r) for x, r in (("q", heads), ("k", kv), ("v", kv))]
            assert torch.equal(mine["layers.1.qkv_proj.bias"], torch.cat([rows(n, r, d) for n, r in parts]))
        gate_up = torch.cat([rows(f"{mlp}.gate_proj.weight", ffn), rows(f"{mlp}.up_proj.weight", ffn)])
        assert torch.equal(mine["layers.1.mlp.gate_up_proj.weight"], gate_up)
        o_cols = full[f"{attn}.o_proj.weight"][:, heads.start * d : heads.stop * d]
        assert torch.equal(mine["layers.1.o_proj.weight"], o_cols)
        down_cols = full[f"{mlp}.down_proj.weight"][:, ffn.start : ffn.stop]
        assert torch.equal(mine["layers.1.mlp.down_proj.weight"], down_cols)
        embed = mine["embed_tokens.weight"]
        assert torch.equal(embed[: len(vocab)], rows("model.embed_tokens.weight", vocab))
        assert not embed[len(vocab) :].any()  # the padding rows
        lm_head = full.get("lm_head.weight", full["model.embed_tokens.weight"])
        assert torch.equal(mine["lm_head.weight"][: len(vocab)], lm_head[vocab.start : vocab.stop])
        assert torch.equal(mine["norm.weight"], full["model.norm.weight"])


# -- parity -------------------------------------------------------------------------------------


@pytest.mark.parametrize("kind", ["qwen3", "mixtral", "qwen3_moe", "gemma3"])
def test_two_ranks_run_the_newer_families(checkpoints, kind: str) -> None:  # noqa: ANN001
    # Qwen3's per-head q/k norms and its O bias (added by rank 0 alone), and experts whose
    # intermediate columns the ranks split, in the NEO pipeline over both ranks' host pools.
    # Gemma 3: sliding and global layers with a RoPE each, embeddings scaled after their sum;
    # a KV group each, so a block holds half the layers: twice the blocks are the same bytes.
    two, stats = generate(checkpoints[kind], 2, "neo", **({"num_gpu_blocks": 24} if kind == "gemma3" else {}))
    assert two == hf_tokens(checkpoints[kind], kind)
    assert stats["num_pipelined_steps"] > 0 and stats["num_prefills_to_host"] > 0, stats


@pytest.mark.parametrize("offload", ["none", "neo", "all"])
@pytest.mark.parametrize("kind", KINDS)
def test_two_ranks_match_one_rank_and_transformers(checkpoints, kind: str, offload: str) -> None:  # noqa: ANN001
    path = checkpoints[kind]
    one, _ = generate(path, 1, offload)
    two, stats = generate(path, 2, offload)
    assert two == one
    assert two == hf_tokens(path, kind)
    if offload == "none":
        assert stats["num_swapped_out"] > 0  # the pool is too small for every request
    else:
        assert stats["num_prefills_to_host"] > 0  # requests decoded over the ranks' host pools
    if offload == "neo":
        assert stats["num_pipelined_steps"] > 0


@pytest.mark.parametrize(
    ("offload", "cpu_kv_dtype", "counter"),
    [
        ("neo", "int8", "prefix_cache_host_hits"),  # prompts decoded in place over host-tier blocks
        ("none", "auto", "num_cache_blocks_to_device"),  # prefix blocks demoted, then copied back
    ],
)
def test_two_ranks_share_prefixes_as_one_rank_does(
    checkpoints, offload: str, cpu_kv_dtype: str, counter: str
) -> None:  # noqa: ANN001
    shared = [7, 8, 9, 10] * 12
    prompts = [[*shared, 20 + i, 30 + i, 40] for i in range(6)]
    tokens, cached = {}, {}
    for tp in (1, 2):
        kw = {**SMALL_POOL, "enable_prefix_caching": True, "num_gpu_blocks": 14}
        llm = LLM(
            str(checkpoints["qwen2"]),
            tensor_parallel_size=tp,
            offload=offload,
            cpu_kv_dtype=cpu_kv_dtype,
            **kw,
        )
        try:
            first = llm.generate(prompts[:3], GREEDY, use_tqdm=False)
            later = llm.generate(prompts[3:], GREEDY, use_tqdm=False)
            tokens[tp] = [o.outputs[0].token_ids for o in first + later]
            cached[tp] = [o.num_cached_tokens for o in later]
            assert llm.engine.scheduler.stats()[counter] > 0
            assert_all_blocks_free(llm.engine)
        finally:
            llm.engine.shutdown()
    assert tokens[2] == tokens[1]
    assert cached[2] == cached[1] and min(cached[2]) >= 40


# -- failure ------------------------------------------------------------------------------------


def _wait_dead(llm: LLM, timeout: float = 10.0) -> EngineDeadError:
    deadline = time.monotonic() + timeout
    while (dead := llm.engine.dead()) is None:
        assert time.monotonic() < deadline, "the engine did not notice its dead worker"
        time.sleep(0.05)
    return dead


def _gone(procs: list, timeout: float = 15.0) -> bool:  # noqa: ANN001
    deadline = time.monotonic() + timeout
    while any(p.is_alive() for p in procs) and time.monotonic() < deadline:
        time.sleep(0.05)
    return not any(p.is_alive() for p in procs)


def test_a_worker_killed_while_idle_stops_the_engine(checkpoints) -> None:  # noqa: ANN001
    llm = LLM(str(checkpoints["qwen2"]), tensor_parallel_size=2, **SMALL_POOL)
    (worker,) = worker_procs(llm)
    os.kill(worker.pid, signal.SIGKILL)
    dead = _wait_dead(llm)
    assert "rank 1 exited with code -9" in str(dead)
    with pytest.raises(EngineDeadError, match="rank 1"):
        llm.generate([PROMPTS[0]], GREEDY, use_tqdm=False)
    assert not llm.engine.has_unfinished()
    llm.engine.shutdown()


def test_a_worker_killed_mid_generation_fails_every_request_within_seconds(checkpoints) -> None:  # noqa: ANN001
    llm = LLM(str(checkpoints["qwen2"]), tensor_parallel_size=2, **SMALL_POOL)
    engine = llm.engine
    for i, p in enumerate(PROMPTS):
        engine.add_request(p, GREEDY, request_id=str(i))
    for _ in range(3):
        engine.step()
    (worker,) = worker_procs(llm)
    os.kill(worker.pid, signal.SIGKILL)
    started = time.monotonic()
    with pytest.raises(EngineDeadError, match="rank 1"):
        while True:  # the step that reaches a collective, or the next one, raises
            engine.step()
    assert time.monotonic() - started < 30  # a hang detector, not a speed figure: gloo sees the closed socket
    assert_all_blocks_free(engine)
    engine.shutdown()


@pytest.mark.parametrize("rank", [0, 1])
def test_a_rank_that_raises_stops_the_engine_and_its_workers(checkpoints, monkeypatch, rank: int) -> None:  # noqa: ANN001
    monkeypatch.setenv("NEO_RS_FAIL_STEPS", "3")
    monkeypatch.setenv("NEO_RS_FAIL_RANK", str(rank))
    llm = LLM(str(checkpoints["mistral"]), tensor_parallel_size=2, **SMALL_POOL)
    engine = llm.engine
    for i, p in enumerate(PROMPTS):
        engine.add_request(p, GREEDY, request_id=str(i))
    engine.step()
    engine.step()
    with pytest.raises(EngineDeadError) as failed:
        engine.step()
    if rank == 0:
        assert "InjectedFault" in str(failed.value)
    assert _gone(worker_procs(llm))
    assert_all_blocks_free(engine)
    with pytest.raises(EngineDeadError):
        engine.step()
    engine.shutdown()


# -- the server ---------------------------------------------------------------------------------


def _children(pid: int, marker: bytes) -> list[int]:
    """Live children of ``pid`` whose command line holds ``marker`` (from /proc)."""
    found = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
            cmdline = (stat.parent / "cmdline").read_bytes()
        except OSError:  # gone meanwhile
            continue
        if int(fields[1]) == pid and fields[0] != "Z" and marker in cmdline:
            found.append(int(stat.parent.name))
    return found


def _workers(pid: int) -> list[int]:
    """The worker ranks a server started (spawned processes)."""
    return _children(pid, b"spawn_main")


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


def test_server_with_two_ranks_serves_and_stops_every_rank() -> None:
    server = Server("--tensor-parallel-size", "2", "--offload", "neo")
    workers = _workers(server.proc.pid)
    try:
        assert workers, "no worker process"
        client = server.client()
        done = client.completions.create(model="neo-rs-demo", prompt="hello", max_tokens=8, temperature=0)
        assert done.usage.completion_tokens == 8
        stream = client.completions.create(model="neo-rs-demo", prompt="hi", max_tokens=6, stream=True)
        finishes = [c.choices[0].finish_reason for c in stream if c.choices]
        assert finishes[-1] == "length"
        chat = client.chat.completions.create(
            model="neo-rs-demo", messages=[{"role": "user", "content": "hi"}], max_tokens=5
        )
        assert chat.choices[0].finish_reason == "length"
        assert server.metric("neo:kv_blocks_used", pool="gpu") == 0
    finally:
        code = server.stop()
    assert code == 0
    assert not [pid for pid in workers if _alive(pid)]


def test_server_turns_unhealthy_and_exits_when_a_worker_dies() -> None:
    server = Server("--tensor-parallel-size", "2")
    try:
        (worker,) = _workers(server.proc.pid)
        os.kill(worker, signal.SIGKILL)
        deadline, status = time.monotonic() + 10, 200
        while status == 200 and time.monotonic() < deadline:
            try:
                with urllib.request.urlopen(server.url + "/health", timeout=1) as r:
                    status = r.status
            except urllib.error.HTTPError as e:
                status = e.code
            except OSError:
                status = 0  # already gone
            time.sleep(0.05)
        assert status != 200
        assert server.proc.wait(30) == 1
    finally:
        server.stop()


def test_workers_exit_when_the_server_is_killed() -> None:
    server = Server("--tensor-parallel-size", "2")
    workers = _workers(server.proc.pid)
    try:
        assert len(workers) == 1
    finally:
        server.stop(signal.SIGKILL)  # no clean-up on rank 0: the worker sees its sockets close
    deadline = time.monotonic() + 15
    while [pid for pid in workers if _alive(pid)] and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not [pid for pid in workers if _alive(pid)]


def test_torchrun_launch_serves_with_rank_0_and_stops_every_rank() -> None:
    torchrun = (sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2")
    server = Server("--tensor-parallel-size", "2", launcher=torchrun)
    ranks = _children(server.proc.pid, b"neo_rs.serve")
    try:
        done = server.client().completions.create(model="neo-rs-demo", prompt="hi", max_tokens=4)
        assert done.usage.completion_tokens == 4
    finally:
        server.stop()
    assert len(ranks) == 2, "torchrun did not start 2 ranks"
    assert not [pid for pid in ranks if _alive(pid)]
