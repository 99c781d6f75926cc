"""Decode iterations replayed from graphs (``worker/graphs.py``). On a CPU device the replay runs
the captured loop over the static buffers again, so these tests check what a GPU's replay
depends on: padded rows touch only the scratch block, the buffers take each iteration's values,
and greedy tokens equal the eager engine's, in every offload mode. On fake CUDA, a graphed
iteration mixes no devices and adds no host sync."""

from __future__ import annotations

import pytest
from conftest import assert_all_blocks_free
from neo_rs import LLM, SamplingParams
from neo_rs.errors import InvalidArgumentError
from neo_rs.serve.cli import engine_args, parse_args
from neo_rs.worker.graphs import buckets
from test_fake_cuda import engine_on, fake_gpu, queue, run

GREEDY = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
PROMPTS = [list(range(3, 10 + 5 * i)) for i in range(7)]  # 7 rows: bucket 8, one padded row


def generate(
    path: str, offload: str, graphs: bool, blocks: int = 12
) -> tuple[dict[str, list[int]], int, dict]:
    """A long request alone first (device decodes only: replayed), then seven more than the
    device pool of ``blocks`` holds (swapped, or under ``neo`` decoded on the CPU: eager
    iterations between replays), all to the end."""
    with LLM(
        path, dtype="float32", block_size=8, offload=offload, num_gpu_blocks=blocks, cuda_graphs=graphs
    ) as llm:
        engine, outs = llm.engine, {}
        engine.add_request(
            list(range(40, 60)), SamplingParams(temperature=0, max_tokens=40, ignore_eos=True), "long"
        )
        for _ in range(5):
            engine.step()
        for i, p in enumerate(PROMPTS):
            engine.add_request(p, GREEDY, str(i))
        while engine.has_unfinished():
            outs.update({o.request_id: o.outputs[0].token_ids for o in engine.step() if o.finished})
        assert_all_blocks_free(engine)
        replays = engine.runner.graphs.replays if graphs else 0
        if graphs:  # the scratch block is the pool's last, past the scheduler's
            assert engine.runner.device_pool.num_blocks == engine.scheduler.num_total_blocks("gpu") + 1
        return outs, replays, engine.scheduler.stats()


@pytest.mark.parametrize("offload", ["none", "neo"])
@pytest.mark.parametrize("kind", ["llama3", "gemma3"])
def test_replayed_decodes_give_the_eager_tokens(checkpoints, kind: str, offload: str) -> None:
    # Gemma 3: two KV groups, each with its slots and tables in the buffers; blocks of half the
    # layers, so twice as many.
    path, blocks = str(checkpoints[kind]), 24 if kind == "gemma3" else 12
    eager, _, _ = generate(path, offload, False, blocks)
    graphed, replays, st = generate(path, offload, True, blocks)
    assert graphed == eager and len(graphed) == 8
    assert replays >= 4  # the long request's first decodes, at least
    # Pressure on the device pool: iterations that move blocks (or decode on the CPU) run eagerly.
    assert st["num_prefills_to_host"] + st["num_swapped_out"] > 0, st


def test_buckets_cover_every_batch() -> None:
    assert buckets(256) == [1, 2, 4, *range(8, 257, 8)]
    assert buckets(6) == [1, 2, 4, 8] and buckets(1) == [1] and buckets(1000)[-1] == 256


def test_flags() -> None:
    assert engine_args(parse_args(["--cuda-graphs"])).cuda_graphs
    args = engine_args(parse_args(["--cuda-graphs", "--enforce-eager"]))
    with pytest.raises(InvalidArgumentError, match="enforce_eager"):
        args.validate()


@pytest.mark.parametrize("kind", ["demo", "gemma2"])
def test_graphed_iterations_on_fake_cuda(monkeypatch, checkpoints, kind: str) -> None:
    with fake_gpu(monkeypatch) as checks:
        model = kind if kind == "demo" else str(checkpoints[kind])
        engine = engine_on(model, offload="none", num_gpu_blocks=64, cuda_graphs=True)
        queue(engine, 5)
        run(engine, checks)  # each iteration, graphed or not, within the sync budget
        assert engine.runner.graphs.replays > 0 and checks.runtime.captures > 0
        engine.shutdown()


def test_padded_rows_write_and_read_only_the_scratch_block(checkpoints) -> None:
    """On a GPU the padded rows' K/V go through the slots (on a CPU the kernel appends by table)."""
    llm = LLM(str(checkpoints["llama3"]), dtype="float32", block_size=8, num_gpu_blocks=64, cuda_graphs=True)
    with llm:
        engine, graphs = llm.engine, llm.engine.runner.graphs
        scratch = engine.scheduler.num_total_blocks("gpu")
        for p in PROMPTS[:3]:
            engine.add_request(p, GREEDY)
        engine.step()  # the prefills
        plan = engine.scheduler.schedule()  # three decodes: bucket 4, one padded row
        bucket = graphs._bucket(4)
        graphs._fill(bucket, plan)
        assert bucket.slot_blocks[0, 3] == scratch and bucket.slot_offsets[0, 3] == 0
        assert bucket.tables[0, 3, 0] == scratch and bucket.lens[3] == 1 and bucket.ids[3] == 0
        assert bucket.lens[:3].tolist() == plan.seq_lens.tolist()
        tables = plan.block_tables  # [groups, rows, blocks]: one KV group
        assert (bucket.tables[:, :3, : tables.shape[2]].numpy() == tables).all()
        assert scratch not in tables[:, :, : -(-int(plan.seq_lens.max()) // 8)]
        engine.scheduler.abort_step()
        for r in list(engine._requests):
            engine.abort(r)
        assert_all_blocks_free(engine)
