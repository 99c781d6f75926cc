"""Engines created and ended in a loop, as notebooks and evaluation scripts do: ``shutdown()``,
``with LLM(...)`` and a plain ``del`` each give back the tensor-parallel workers and their
process group, both KV pools, the CPU kernel's threads and the grammar worker; an engine used
after its shutdown raises ``EngineDeadError``."""

from __future__ import annotations

import asyncio
import gc
import logging
import multiprocessing
import os
import threading
import time
import weakref

import pytest
import torch
from neo_rs import LLM, EngineDeadError, SamplingParams, StructuredOutputsParams
from tqdm import tqdm

GREEDY = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
JSON = SamplingParams(
    temperature=0, max_tokens=8, structured_outputs=StructuredOutputsParams(json={"type": "object"})
)
PROMPTS = ["Hello, NEO!", "Paged attention"]
# Device blocks for one request: the other decodes on the CPU (neo), so the host pool is used.
SMALL = dict(num_gpu_blocks=2, cpu_kv_gib=0.05, offload="neo", neo_force_pipeline=True, cpu_threads=2)


def rss_mib() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


def os_threads() -> int:
    """Native threads too (the Rust kernel's, llguidance's), which ``threading`` does not see."""
    return len(os.listdir("/proc/self/task"))


def settled(check, timeout: float = 10.0) -> bool:  # noqa: ANN001 (a predicate)
    """Threads and processes end a moment after they are told to."""
    deadline = time.monotonic() + timeout
    while not check() and time.monotonic() < deadline:
        time.sleep(0.05)
    return check()


def run_one(tp: int, end: str) -> LLM | None:
    """One engine, generating (with a grammar, so that its worker starts), ended by ``end``;
    returns the ``LLM`` object when the caller still holds it (as a notebook would), and checks
    that its device pool is gone all the same."""
    llm = LLM(None, tensor_parallel_size=tp, **SMALL)
    outs = llm.generate(PROMPTS, [GREEDY, JSON], use_tqdm=False)
    assert all(len(o.outputs[0].token_ids) > 0 for o in outs)
    assert llm.engine.scheduler.stats()["num_pipelined_steps"] > 0
    pool = weakref.ref(llm.engine.runner.device_pool.k)
    kept: LLM | None = llm
    if end == "shutdown":
        llm.shutdown()
        llm.shutdown()  # idempotent
        with pytest.raises(EngineDeadError, match="shutdown"):
            llm.generate(PROMPTS[:1], GREEDY, use_tqdm=False)
    elif end == "with":
        with llm:
            pass
    else:
        del llm, outs
        kept = None
    gc.collect()
    assert pool() is None, "the device pool outlived its engine's end"
    return kept


@pytest.mark.parametrize("end", ["shutdown", "with", "del"])
@pytest.mark.parametrize("tp", [1, 2], ids=["tp1", "tp2"])
def test_five_engines_in_a_row_give_back_what_they_hold(
    tp: int, end: str, caplog: pytest.LogCaptureFixture
) -> None:
    # tqdm starts one monitor thread of its own with its first bar, even a disabled one (the
    # loader's), and keeps it for later bars: start it before the baseline.
    tqdm(disable=True).close()
    threads_before = set(threading.enumerate())
    rss, native, held = [], [], []
    with caplog.at_level(logging.WARNING, logger="neo_rs.engine.llm_engine"):
        for _ in range(5):
            held.append(run_one(tp, end))  # the ended engines stay referenced
            assert settled(lambda: not multiprocessing.active_children()), multiprocessing.active_children()
            assert settled(lambda: set(threading.enumerate()) <= threads_before), threading.enumerate()
            # Native threads: the process's own pools (torch's OpenMP team) start with the first
            # engine and stay; each engine's CPU-kernel threads must go with it.
            assert settled(lambda: not native or os_threads() <= native[0]), (os_threads(), native)
            native.append(os_threads())
            rss.append(rss_mib())
    print(f"RSS after engines 1..5 ({tp=}, {end}): " + ", ".join(f"{r:.0f}" for r in rss) + " MiB")
    assert rss[-1] <= rss[0] * 1.10
    collected = "garbage-collected without shutdown()" in caplog.text
    assert collected == (end == "del")  # the warning names shutdown(), and only when it was skipped


def test_shutdown_gives_torch_its_thread_count_back() -> None:
    # The engine sets torch's intra-op threads for the process (its CPU kernel's count, or under
    # tensor parallelism a rank's share); the next engine must not inherit them.
    before = torch.get_num_threads()
    llm = LLM("demo", cpu_threads=1)
    assert torch.get_num_threads() == 1
    llm.shutdown()
    assert torch.get_num_threads() == before


def test_an_engine_after_shutdown_raises_engine_dead() -> None:
    llm = LLM(None, **SMALL)
    llm.engine.add_request("left running", GREEDY, request_id="r")
    llm.shutdown()
    for call in (
        lambda: llm.engine.step(),
        lambda: llm.engine.add_request("x", GREEDY),
        lambda: llm.engine.abort("r"),
    ):
        with pytest.raises(EngineDeadError, match="shutdown"):
            call()


def test_async_engine_as_a_context_manager() -> None:
    from neo_rs.config import EngineArgs
    from neo_rs.engine.async_engine import AsyncEngine

    async def main() -> AsyncEngine:
        async with AsyncEngine(EngineArgs(**SMALL)) as engine:
            await asyncio.get_running_loop().run_in_executor(None, engine.ready.wait)
            assert engine.load_error is None and engine.engine is not None
            ids = engine.engine.tokenize("Hello")
            outs = [o async for o in engine.generate("r", "Hello", ids, GREEDY)]
            assert outs[-1].finished and len(outs[-1].outputs[0].token_ids) == 8
        with pytest.raises(EngineDeadError, match="shutdown"):
            async for _ in engine.generate("s", "Hello", ids, GREEDY):
                pass
        await engine.shutdown()  # idempotent
        return engine

    engine = asyncio.run(main())
    assert engine.engine is not None and engine.engine.dead() is not None  # shut down by its thread
    assert not any(t.name.startswith(("neo-engine", "neo-tokenize")) for t in threading.enumerate())
