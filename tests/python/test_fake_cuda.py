"""The engine's CUDA path, run without a GPU (``fake_cuda.py``): every iteration of every offload
mode, the prefix cache's two tiers, swaps, chunked prefill, structured outputs, int8 host KV,
a Llama-3-8B-shaped model at 2 and 32 layers, a Qwen3-30B-A3B-shaped MoE, one AsyncEngine
request and two tensor-parallel ranks. Each iteration mixes
no devices, reads no CUDA scalar, and waits for the device as often as the budget says
(``SYNCS_PER_ITERATION``), whatever the number of layers. Two planted defects show the checks
bite."""

from __future__ import annotations

import asyncio
import dataclasses
import json
import resource
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.multiprocessing as mp
from conftest import assert_all_blocks_free
from fake_cuda import CudaChecks, DeviceCheckError, FakeCuda, fake_rank
from neo_rs import LLMEngine, SamplingParams
from neo_rs.config import EngineArgs
from neo_rs.cuda_runtime import use_runtime
from neo_rs.engine.async_engine import AsyncEngine
from neo_rs.errors import EngineStepError
from neo_rs.kv.transfer import HostTransfer
from neo_rs.sample.structured import StructuredOutputsParams
from server_util import free_port
from test_prefix_cache import PROMPTS

# The host waits for the device once an iteration: to read the sampled tokens (docs/gpu.md).
SYNCS_PER_ITERATION = 1
GREEDY = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)


@contextmanager
def fake_gpu(monkeypatch: pytest.MonkeyPatch, backend: str = "triton", **kw: Any) -> Iterator[CudaChecks]:
    monkeypatch.setenv("NEO_RS_DEVICE_ATTENTION", backend)
    rt = FakeCuda(**kw)
    with use_runtime(rt), CudaChecks(rt) as checks:
        yield checks


def run(engine: LLMEngine, checks: CudaChecks) -> list[str]:
    """Step until every request is done, holding each iteration to the sync budget; the modes
    the iterations ran in."""
    modes = []
    while engine.has_unfinished():
        before = checks.syncs
        engine.step()
        if engine.last_stats is not None:
            modes.append(engine.last_stats.mode)
            assert checks.syncs - before == SYNCS_PER_ITERATION, engine.last_stats
    return modes


def engine_on(model: str, **kw: Any) -> LLMEngine:
    args = dict(model=model, device="cuda", dtype="bfloat16", block_size=8, num_cpu_blocks=128)
    return LLMEngine(EngineArgs(**{**args, **kw}))


def queue(engine: LLMEngine, n: int = 6, params: SamplingParams = GREEDY) -> None:
    for i in range(n):
        engine.add_request(list(range(3, 30 + i)), params)


MODES = {
    "none": (dict(offload="none", num_gpu_blocks=64), {"gpu-only"}),
    "neo-forced": (dict(offload="neo", num_gpu_blocks=10, neo_force_pipeline=True), {"pipelined"}),
    "neo": (dict(offload="neo", num_gpu_blocks=10), {"sequential", "pipelined"}),
    "all": (dict(offload="all", num_gpu_blocks=64), {"sequential"}),
}


@pytest.mark.parametrize("backend", ["triton", "torch"])
@pytest.mark.parametrize("mode", list(MODES))
def test_iterations_of_every_mode(monkeypatch, mode: str, backend: str) -> None:
    kw, expected = MODES[mode]
    with fake_gpu(monkeypatch, backend) as checks:
        engine = engine_on("demo", **kw)
        queue(engine)
        modes = run(engine, checks)
        assert expected & set(modes), modes
        assert_all_blocks_free(engine)
        engine.shutdown()


@pytest.mark.parametrize("mode", ["none", "neo-forced"])
def test_two_ranks_each_on_a_fake_gpu(monkeypatch, mode: str) -> None:
    """TP=2 as a launcher starts it: this process is rank 0 (the engine), a spawned process rank
    1 (the production worker), each under its own checks; device collectives go through torch's
    fake process group, the plan over gloo for real."""
    env = {
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(free_port()),
        "WORLD_SIZE": "2",
        "NEO_RS_DEVICE_ATTENTION": "triton",
    }
    for k, v in {**env, "RANK": "0"}.items():
        monkeypatch.setenv(k, v)
    ctx = mp.get_context("spawn")
    receiver, sender = ctx.Pipe(duplex=False)
    worker = ctx.Process(target=fake_rank, args=(1, 2, {**env, "RANK": "1"}, sender), daemon=True)
    worker.start()
    try:
        kw, expected = MODES[mode]
        with fake_gpu(monkeypatch) as checks:
            engine = engine_on("demo", tensor_parallel_size=2, **kw)
            queue(engine)
            modes = run(engine, checks)
            assert expected & set(modes), modes
            assert_all_blocks_free(engine)
            engine.shutdown()
        worker.join(60)
        assert worker.exitcode == 0, "rank 1 failed its checks (its log says why)"
        # Rank 1 never waits for its device in an iteration: it neither samples nor reads tokens.
        code, syncs = receiver.recv()
        assert code == 0 and len(syncs) >= 2 * len(modes) and not any(syncs), syncs
    finally:
        if worker.is_alive():
            worker.terminate()


@pytest.mark.parametrize("backend", ["triton", "torch"])
@pytest.mark.parametrize("kind", ["gemma2", "gemma3"])
def test_sliding_windows_and_soft_caps(monkeypatch, checkpoints, kind: str, backend: str) -> None:
    """Gemma's sliding and global layers (capped scores and logits, two RoPE tables; a KV group
    each) in NEO's pipeline, then in later prefill chunks beside first ones (no prefix hits to
    shorten them): each kernel gets its layer's kind and its group's tables, within the budget."""
    with fake_gpu(monkeypatch, backend) as checks:
        engine = engine_on(
            str(checkpoints[kind]),
            offload="neo",
            num_gpu_blocks=10,
            max_num_batched_tokens=16,
            neo_force_pipeline=True,
        )
        queue(engine)
        assert "pipelined" in run(engine, checks)
        assert_all_blocks_free(engine)
        engine.shutdown()
        engine = engine_on(
            str(checkpoints[kind]), num_gpu_blocks=64, max_num_batched_tokens=16, enable_prefix_caching=False
        )
        queue(engine)
        run(engine, checks)
        if backend == "triton":
            assert checks.ops["neo_rs.paged_decode.default"] and checks.ops["neo_rs.paged_prefill.default"], (
                checks.ops
            )
        assert_all_blocks_free(engine)
        engine.shutdown()


def test_swaps_chunked_prefill_and_int8_host_kv(monkeypatch) -> None:
    with fake_gpu(monkeypatch) as checks:
        # Six requests of up to 41 tokens in 12 blocks of 8: some are swapped out and back.
        engine = engine_on("demo", offload="none", num_gpu_blocks=12, max_num_batched_tokens=16)
        queue(engine, params=SamplingParams(temperature=0, max_tokens=12, ignore_eos=True))
        run(engine, checks)
        st = engine.scheduler.stats()
        assert st["num_swapped_out"] > 0, st
        engine.shutdown()
        engine = engine_on(
            "demo", offload="neo", num_gpu_blocks=10, cpu_kv_dtype="int8", neo_force_pipeline=True
        )
        queue(engine)
        assert "pipelined" in run(engine, checks)
        assert_all_blocks_free(engine)
        engine.shutdown()


@pytest.mark.parametrize("offload", ["none", "neo", "all"])
def test_prefix_cache_hits_in_both_tiers(monkeypatch, offload: str) -> None:
    with fake_gpu(monkeypatch) as checks:
        kw = dict(offload=offload, num_gpu_blocks=5 if offload == "all" else 6, enable_prefix_caching=True)
        if offload == "all":
            kw["max_num_batched_tokens"] = 16
        engine = engine_on("demo", num_cpu_blocks=64, **kw)
        for i in [0, 6, 3, 6, 2]:  # test_prefix_cache's order that hits the host tier
            engine.add_request(PROMPTS[i], SamplingParams(temperature=0, max_tokens=10, ignore_eos=True))
            run(engine, checks)
        st = engine.scheduler.stats()
        assert (
            st["prefix_cache_host_hits"] >= 16 and st["prefix_cache_hits"] > st["prefix_cache_host_hits"]
        ), st
        assert_all_blocks_free(engine)
        engine.shutdown()


def test_structured_output_masks(monkeypatch) -> None:
    with fake_gpu(monkeypatch) as checks:
        engine = engine_on("demo", offload="neo", num_gpu_blocks=10, neo_force_pipeline=True)
        a = engine.tokenize("a", add_special_tokens=False)[0]
        checks.runtime.values = lambda t: [a] * t.numel()  # what the grammar allows
        queue(
            engine,
            params=SamplingParams(
                temperature=0, max_tokens=6, structured_outputs=StructuredOutputsParams(regex="a{1,20}")
            ),
        )
        run(engine, checks)
        engine.shutdown()


SAMPLED = SamplingParams(
    temperature=0.8,
    top_p=0.9,
    top_k=20,
    min_p=0.05,
    repetition_penalty=1.1,
    max_tokens=6,
    ignore_eos=True,
)


def test_sampling_reads_the_device_once_and_once_more_for_logprobs(monkeypatch) -> None:

    with fake_gpu(monkeypatch) as checks:
        engine = engine_on("demo", offload="neo", num_gpu_blocks=10, neo_force_pipeline=True)
        for i, params in enumerate(
            [SAMPLED, dataclasses.replace(SAMPLED, seed=7), dataclasses.replace(GREEDY, logprobs=3)]
        ):
            engine.add_request(list(range(3, 30 + i)), params)
        while engine.has_unfinished():
            before = checks.syncs
            outs = engine.step()
            logprobs = any(o.outputs[0].logprobs for o in outs)
            assert checks.syncs - before == SYNCS_PER_ITERATION + logprobs
        engine.shutdown()


def llama3_8b_shaped(root: Path, num_layers: int) -> Path:
    """Llama-3-8B's config.json (at ``num_layers``) beside an empty weights file: the weights
    are fakes of the right shapes (``fake_weights``)."""
    from transformers import LlamaConfig

    cfg = LlamaConfig(
        vocab_size=128256,
        hidden_size=4096,
        intermediate_size=14336,
        num_hidden_layers=num_layers,
        num_attention_heads=32,
        num_key_value_heads=8,
        max_position_embeddings=8192,
        rope_theta=500000.0,
        torch_dtype="bfloat16",
    )
    path = root / f"llama3-8b-{num_layers}"
    path.mkdir()
    (path / "config.json").write_text(json.dumps({**cfg.to_dict(), "architectures": ["LlamaForCausalLM"]}))
    (path / "model.safetensors").touch()
    return path


class _FakeSlice:
    def __init__(self, checks: CudaChecks, shape: torch.Size) -> None:
        self.checks, self.shape = checks, shape

    def get_shape(self) -> list[int]:
        return list(self.shape)

    def __getitem__(self, at: Any) -> torch.Tensor:
        meta = torch.empty(self.shape, dtype=torch.bfloat16, device="meta")[at]
        fake = self.checks.fake
        return fake.fake_tensor_converter.from_meta_and_device(fake, meta, torch.device("cpu"))


def _per_expert(shapes: dict[str, torch.Size]) -> dict[str, torch.Size]:
    """transformers' stacked expert tensors as checkpoints on the Hub store them: per expert."""
    out = {}
    for name, shape in shapes.items():
        if name.endswith("mlp.experts.gate_up_proj"):
            experts, rows, cols = shape
            for e in range(experts):
                for part in ("gate_proj", "up_proj"):
                    out[name.replace("gate_up_proj", f"{e}.{part}.weight")] = torch.Size([rows // 2, cols])
        elif name.endswith("mlp.experts.down_proj"):
            for e in range(shape[0]):
                out[name.replace("down_proj", f"{e}.down_proj.weight")] = torch.Size(shape[1:])
        else:
            out[name] = shape
    return out


def fake_weights(monkeypatch: pytest.MonkeyPatch, checks: CudaChecks, path: Path) -> None:
    """The loader reads fakes of the shapes transformers gives this config: nothing allocated."""
    from transformers import AutoConfig, AutoModelForCausalLM

    with torch.device("meta"):
        shapes = _per_expert(
            {
                n: p.shape
                for n, p in AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(path))
                .state_dict()
                .items()
            }
        )

    class Checkpoint:
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            pass

        def __enter__(self) -> Checkpoint:
            return self

        def __exit__(self, *exc: object) -> None:
            pass

        def keys(self) -> list[str]:
            return list(shapes)

        def get_slice(self, name: str) -> _FakeSlice:
            return _FakeSlice(checks, shapes[name])

    monkeypatch.setattr("neo_rs.model.loader.safe_open", Checkpoint)


@pytest.mark.parametrize("num_layers", [2, 32])
def test_llama3_8b_shapes_cost_the_same_syncs_at_any_depth(monkeypatch, tmp_path, num_layers: int) -> None:
    rss_before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    with fake_gpu(monkeypatch) as checks:
        path = llama3_8b_shaped(tmp_path, num_layers)
        fake_weights(monkeypatch, checks, path)
        engine = engine_on(
            str(path),
            skip_tokenizer_init=True,
            offload="neo",
            num_gpu_blocks=10,
            num_cpu_blocks=64,
            neo_force_pipeline=True,
            max_model_len=512,
        )
        queue(engine, 3)
        queue(engine, 3, dataclasses.replace(SAMPLED, top_k=0))  # top-p over a 128k vocabulary
        assert "pipelined" in run(engine, checks)
        assert_all_blocks_free(engine)
        engine.shutdown()
    # 8B parameters in bf16 are 16 GiB; a fake model takes nothing of that (the host pool's 64
    # blocks are 32 MiB at 32 layers).
    grown_mib = (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - rss_before) / 1024
    assert grown_mib < 2048, grown_mib


def test_qwen3_moe_shapes_group_experts_without_reading_the_device(monkeypatch, tmp_path) -> None:
    # Qwen3-30B-A3B's shapes at 2 of its 48 layers: 128 experts, 8 per token, on the fused MoE
    # kernel's op, within the same one read per iteration.
    from transformers import Qwen3MoeConfig

    cfg = Qwen3MoeConfig(
        vocab_size=151936,
        hidden_size=2048,
        intermediate_size=6144,
        moe_intermediate_size=768,
        num_hidden_layers=2,
        num_attention_heads=32,
        num_key_value_heads=4,
        head_dim=128,
        num_experts=128,
        num_experts_per_tok=8,
        norm_topk_prob=True,
        torch_dtype="bfloat16",
    )
    path = tmp_path / "qwen3-30b-a3b-2"
    path.mkdir()
    (path / "config.json").write_text(json.dumps({**cfg.to_dict(), "architectures": ["Qwen3MoeForCausalLM"]}))
    (path / "model.safetensors").touch()
    with fake_gpu(monkeypatch) as checks:
        fake_weights(monkeypatch, checks, path)
        engine = engine_on(
            str(path),
            skip_tokenizer_init=True,
            offload="neo",
            num_gpu_blocks=10,
            neo_force_pipeline=True,
            max_model_len=512,
        )
        queue(engine, 4)
        assert "pipelined" in run(engine, checks)
        assert_all_blocks_free(engine)
        engine.shutdown()


def test_one_async_engine_request(monkeypatch) -> None:
    with fake_gpu(monkeypatch) as checks:

        class OnFakeCuda(AsyncEngine):
            def _main(self) -> None:  # the checks hold per thread: the engine's own enters them
                with checks:
                    super()._main()

        async def generate() -> list[int]:
            async with OnFakeCuda(
                EngineArgs(model="demo", device="cuda", offload="neo", num_gpu_blocks=10, block_size=8)
            ) as engine:
                assert engine.ready.wait(120) and engine.load_error is None, engine.load_error
                prompt = list(range(3, 40))
                outs = [out async for out in engine.generate("r0", prompt, prompt, GREEDY)]
                assert outs[-1].finished
                return outs[-1].outputs[0].token_ids

        assert len(asyncio.run(generate())) == GREEDY.max_tokens
        assert checks.syncs >= GREEDY.max_tokens  # the engine thread ran under the checks


def test_a_scalar_read_in_the_forward_fails_the_check(monkeypatch) -> None:
    with fake_gpu(monkeypatch):
        engine = engine_on("demo", offload="none", num_gpu_blocks=64)
        layer = engine.runner.model.decoder_layers[0]
        real = layer.post_attention

        def post_with_item(out: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
            if out.norm().item() > 0:  # the planted defect: a host sync
                pass
            return real(out, x)

        monkeypatch.setattr(layer, "post_attention", post_with_item)
        queue(engine, 1)
        with pytest.raises(EngineStepError) as err:
            engine.step()
        assert isinstance(err.value.__cause__, DeviceCheckError)
        engine.shutdown()


@pytest.mark.parametrize("backend", ["triton", "torch"])
def test_host_metadata_meeting_the_device_fails_the_check(monkeypatch, backend: str) -> None:
    with fake_gpu(monkeypatch, backend):
        engine = engine_on("demo", offload="none", num_gpu_blocks=64)
        queue(engine, 2)
        engine.step()  # the prefill; then decodes read block tables and slots
        # The planted defect: metadata left in host memory instead of uploaded.
        monkeypatch.setattr(HostTransfer, "upload", lambda self, t: t)
        with pytest.raises(EngineStepError) as err:
            engine.step()
        assert isinstance(err.value.__cause__, DeviceCheckError | ValueError), err.value.__cause__
        assert "device" in str(err.value.__cause__)
        engine.shutdown()
