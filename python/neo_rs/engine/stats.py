"""Per-iteration statistics the engine publishes (the server's metrics read them): the mode
the scheduler chose, what ran where, swaps, CPU attention time, host<->device bytes, predicted
against measured stage times, and pool usage."""

from __future__ import annotations

from dataclasses import dataclass, field

from neo_rs._core import Scheduler, SchedulerOutput
from neo_rs.timing import MeasuredTimes


@dataclass
class IterationStats:
    mode: str  # gpu-only | sequential (CPU decodes in one batch) | pipelined (two sub-batches)
    num_prefills: int
    num_gpu_decodes: int
    num_cpu_decodes: int
    num_swapped_out_blocks: int
    num_swapped_in_blocks: int
    num_prefill_to_host_blocks: int
    num_recomputed: int
    cpu_attn_ms: float  # CPU attention kernels, whole iteration
    transfer_bytes: int  # Q/K/V and outputs of CPU decodes, whole iteration
    iteration_ms: float
    predicted_layer_ms: dict[str, float]
    measured_layer_ms: dict[str, float] = field(default_factory=dict)
    gpu_blocks_used: int = 0
    gpu_blocks_total: int = 0
    cpu_blocks_used: int = 0
    cpu_blocks_total: int = 0
    # Speculative decoding: sequences that verified drafts, their draft tokens, and how many
    # sequences accepted their i-th draft (the accepted tokens are its sum).
    num_drafts: int = 0
    num_draft_tokens: int = 0
    accepted_per_position: list[int] = field(default_factory=list)

    @staticmethod
    def build(
        plan: SchedulerOutput,
        times: MeasuredTimes,
        scheduler: Scheduler,
        num_layers: int,
        iteration_ms: float,
    ) -> IterationStats:
        n, s1 = len(plan.req_ids), plan.sub_batch1_start
        num_cpu = plan.num_cpu_decodes + (n - s1)
        mode = "pipelined" if s1 < n else ("sequential" if num_cpu else "gpu-only")
        measured = dict(times.settle(num_layers))
        return IterationStats(
            mode=mode,
            num_prefills=s1 - plan.num_decodes,
            num_gpu_decodes=plan.num_decodes - plan.num_cpu_decodes,
            num_cpu_decodes=num_cpu,
            num_swapped_out_blocks=len(plan.swap_out),
            num_swapped_in_blocks=len(plan.swap_in),
            num_prefill_to_host_blocks=len(plan.prefill_to_host),
            num_recomputed=len(plan.recomputed),
            cpu_attn_ms=sum(times.cpu_attn_ms),
            transfer_bytes=times.transfer_bytes,
            iteration_ms=iteration_ms,
            predicted_layer_ms=dict(plan.predicted),
            measured_layer_ms=measured,
            gpu_blocks_used=scheduler.num_total_blocks("gpu") - scheduler.num_free_blocks("gpu"),
            gpu_blocks_total=scheduler.num_total_blocks("gpu"),
            cpu_blocks_used=scheduler.num_total_blocks("cpu") - scheduler.num_free_blocks("cpu"),
            cpu_blocks_total=scheduler.num_total_blocks("cpu"),
        )


def calibrate(scheduler: Scheduler, plan: SchedulerOutput, times: MeasuredTimes, num_layers: int) -> None:
    """Feed every measured stage time back into the predictor, in every mode: each term against
    what the plan predicted for it (the CPU kernels of both sub-batches together, the linear
    work of both, the copies the plan priced)."""
    p, measured = plan.predicted, times.settle(num_layers)
    for term, key, predicted in (
        ("linear", "linear", p["linear0"] + p["linear1"]),
        ("prefill_attn", "prefill_attn", p["prefill_attn"]),
        ("gpu_decode", "gpu_decode", p["gpu_decode"]),
        ("transfer", "copy", p["copy"]),
        ("cpu_decode", "cpu_attn", p["cpu_attn0"] + p["cpu_attn1"]),
    ):
        if key in measured:
            scheduler.observe(term, predicted, measured[key])
