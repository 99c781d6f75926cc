"""Discrete-event simulation of the engine: requests arrive, the real Rust scheduler plans each
iteration (the same code the server runs), and the cost model prices it: the plan's per-layer
time from the predictor (fed by the cost model) times the layers, plus its whole-request swaps
over PCIe and a per-iteration overhead."""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass

from neo_rs._core import Scheduler
from neo_rs.bench.arrivals import arrival_times
from neo_rs.bench.workloads import BenchRequest
from neo_rs.sim.cost import CostModel


@dataclass
class SimResult:
    mode: str
    completed: int
    rejected: int
    makespan_s: float
    output_throughput: float  # tokens/s
    request_throughput: float
    # Completions per arrival while requests still arrive, from the quarter mark on (warm-up and
    # final drain excluded): about 1 when the mode keeps up, lower as its backlog grows; 1 when
    # all arrive at once.
    keep_up: float
    per_token_latency_ms: float  # mean of end-to-end / output tokens (NEO's latency metric)
    ttft_ms: float  # median
    iterations: int
    pipelined_share: float
    cpu_decode_share: float
    scheduler_us_per_iteration: float


def simulate(
    cost: CostModel,
    mode: str,
    requests: list[BenchRequest],
    arrivals: list[float],
    max_num_seqs: int = 256,
    max_num_batched_tokens: int = 4096,
) -> SimResult:
    m = cost.rank_model  # under tensor parallelism, every rank schedules the same; this is one
    sched = Scheduler(
        max_num_seqs=max_num_seqs,
        max_num_batched_tokens=max_num_batched_tokens,
        max_model_len=m.max_len,
        block_size=cost.block_size,
        num_gpu_blocks=max(1, cost.num_gpu_blocks()),
        num_cpu_blocks=cost.num_cpu_blocks(),
        offload=mode,
        transfer_bytes_per_decode=cost.transfer_bytes_per_decode(),
        kv_bytes_per_token=m.kv_bytes_per_token_layer(),
    )
    cost.tables(max_num_batched_tokens).apply(sched)
    block_ms = cost.transfer_ms(cost.block_bytes())
    n = len(requests)
    first_token = [0.0] * n
    finished = [0.0] * n
    rejected = [False] * n
    t, i = 0.0, 0
    iterations = pipelined = cpu_rows = rows = 0
    sched_s = 0.0
    while i < n or sched.has_unfinished():
        while i < n and arrivals[i] <= t:
            r = requests[i]
            try:
                sched.add_request(i, [1] * r.prompt_len, r.output_len)
            except ValueError:
                rejected[i] = True
            i += 1
        if not sched.has_unfinished():
            if i < n:
                t = max(t, arrivals[i])
            continue
        t0 = time.perf_counter()
        plan = sched.schedule()
        sched_s += time.perf_counter() - t0
        swaps = len(plan.swap_out) + len(plan.swap_in)
        dt_ms = m.num_layers * plan.predicted["layer"] + swaps * block_ms + cost.eff.iteration_ms
        t += dt_ms / 1e3
        iterations += 1
        num = len(plan.req_ids)
        pipelined += plan.sub_batch1_start < num
        cpu_rows += plan.num_cpu_decodes + (num - plan.sub_batch1_start)
        rows += plan.num_decodes + (num - plan.sub_batch1_start)
        sampled = plan.sample_ids.tolist()
        for sid in sampled:
            if first_token[sid] == 0.0:
                first_token[sid] = t
        t0 = time.perf_counter()
        for sid, _ in sched.update([1] * len(sampled), []):
            finished[sid] = t
        sched_s += time.perf_counter() - t0
    done = [k for k in range(n) if not rejected[k]]
    tokens = sum(requests[k].output_len for k in done)
    start = min((arrivals[k] for k in done), default=0.0)
    makespan = max((finished[k] for k in done), default=0.0) - start
    lo, hi = (arrivals[n // 4], arrivals[-1]) if n else (0.0, 0.0)
    arrived = sum(lo < arrivals[k] <= hi for k in done)
    completed = sum(lo < finished[k] <= hi for k in done)
    return SimResult(
        mode=mode,
        completed=len(done),
        rejected=n - len(done),
        makespan_s=makespan,
        output_throughput=tokens / makespan if makespan else 0.0,
        request_throughput=len(done) / makespan if makespan else 0.0,
        keep_up=completed / arrived if arrived else 1.0,
        per_token_latency_ms=statistics.fmean(
            (finished[k] - arrivals[k]) / requests[k].output_len * 1e3 for k in done
        )
        if done
        else 0.0,
        ttft_ms=statistics.median((first_token[k] - arrivals[k]) * 1e3 for k in done) if done else 0.0,
        iterations=iterations,
        pipelined_share=pipelined / iterations if iterations else 0.0,
        cpu_decode_share=cpu_rows / rows if rows else 0.0,
        scheduler_us_per_iteration=sched_s / iterations * 1e6 if iterations else 0.0,
    )


def verdict(cost: CostModel, results: dict[str, SimResult]) -> str:
    """A plain-language answer: does offloading pay here, and what bounds it."""
    neo, none = results.get("neo"), results.get("none")
    if neo is None or none is None or not none.output_throughput:
        return "run both 'neo' and 'none' for a verdict"
    gain = neo.output_throughput / none.output_throughput - 1
    seqs_on_gpu = cost.num_gpu_blocks() * cost.block_size
    if gain > 0.05:
        why = (
            f"GPU-memory bound: the device KV pool holds only {seqs_on_gpu} tokens, so the GPU batch "
            f"is small; host attention lets it grow ({neo.cpu_decode_share:.0%} of decodes ran on the CPU)"
        )
        return f"CPU offloading helps: +{gain:.0%} throughput. {why}."
    if neo.cpu_decode_share > 0.05:
        return (
            f"CPU offloading barely pays ({gain:+.0%}): CPU-bandwidth bound, the host's "
            f"{cost.host.mem_gbps:.0f} GB/s cannot hide its attention under the GPU's work."
        )
    return (
        f"CPU offloading does not pay ({gain:+.0%}): the GPU is not memory bound for this load "
        f"(its KV pool holds {seqs_on_gpu} tokens), so NEO falls back to GPU-only iterations."
    )


def capacity_at_slo(
    cost: CostModel,
    mode: str,
    requests: list[BenchRequest],
    slo_ms_per_token: float,
    seed: int = 0,
    max_num_seqs: int = 256,
    max_num_batched_tokens: int = 4096,
) -> tuple[float, SimResult | None]:
    """The highest Poisson rate (req/s) the mode sustains with the mean per-token latency within
    the SLO (NEO's equal-latency comparison), by bisection; with the run at that rate. Sustained
    means it also keeps up (`SimResult.keep_up` >= 0.95): a finite run past capacity can end
    before its queue has hurt the mean latency. Runs of long outputs need enough requests (about
    1,000) to reach their steady state."""

    def at(rate: float) -> tuple[bool, SimResult]:
        arrivals = arrival_times(len(requests), rate, 1.0, seed)
        r = simulate(cost, mode, requests, arrivals, max_num_seqs, max_num_batched_tokens)
        return r.per_token_latency_ms <= slo_ms_per_token and r.keep_up >= 0.95, r

    lo, hi, best = 0.0, 1.0, None
    while (step := at(hi))[0] and hi < 1e4:
        lo, hi, best = hi, hi * 2, step[1]
    for _ in range(12):
        mid = (lo + hi) / 2
        ok, r = at(mid)
        if ok:
            lo, best = mid, r
        else:
            hi = mid
    return lo, best
