"""The device memory an iteration needs beyond the weights and the KV pools, planned before the
pools are sized. vLLM finds it with a profiling run on the GPU; we run one worst-case iteration on
fake tensors (``FakeTensorMode``: shapes and devices, no memory) under torch's ``MemTracker``,
which follows every allocation the device's allocator would make and reports the peak. No GPU
is needed, so CI checks the plan a GPU gets (``tests/python/test_memory_plan.py``), and
``benches/gpu_check.py`` holds it against the allocator's real peak where a GPU is lent.

The worst case: a first prefill chunk of the whole token budget (its linears, its attention, its
MLP) whose last ``max_num_seqs`` rows are sampled, every one at random with top-k, top-p, min-p
and logprobs (a full sort of the vocabulary per row)."""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.distributed._tools.mem_tracker import MemTracker, _MemRefType

from neo_rs.attention.layer import attend_positions
from neo_rs.config import AttentionKind
from neo_rs.cuda_runtime import runtime
from neo_rs.model.decoder import CausalLM
from neo_rs.sample.sampling import SampleRow, SamplingParams, draw

# Over the traced peak: the caching allocator rounds blocks up (to 2 MiB segments for large ones)
# and fragments; cuBLAS, cuDNN and the Triton launcher keep workspaces the trace does not see.
MARGIN = 0.25
WORKSPACE_BYTES = 256 << 20
# The sampler's worst row: every filter on, and 20 logprobs (the most the server allows).
WORST_ROW = SamplingParams(temperature=1.0, top_k=50, top_p=0.9, min_p=0.05, logprobs=20)


class MemoryPlanError(AssertionError):
    """An iteration needed more device memory than its plan keeps free."""


@dataclass(frozen=True)
class ActivationPlan:
    tokens: int  # the iteration traced: a prefill of this many tokens
    rows: int  # of which this many were sampled
    peak_bytes: int  # allocated at once beyond the weights and pools, as traced

    @property
    def reserve_bytes(self) -> int:
        """What the runner leaves free of KV blocks for activations."""
        return int(self.peak_bytes * (1 + MARGIN)) + WORKSPACE_BYTES

    def check(self, measured_bytes: int) -> None:
        """Raise ``MemoryPlanError`` when an iteration took more than the plan keeps for it
        (``measured_bytes``: its peak beyond the weights and the pools, traced or measured)."""
        room = self.reserve_bytes - WORKSPACE_BYTES
        if measured_bytes > room:
            raise MemoryPlanError(
                f"an iteration's activations reached {measured_bytes / 2**20:.1f} MiB, over the "
                f"{room / 2**20:.1f} MiB planned for {self.tokens} tokens and {self.rows} sampled rows"
            )


class AllocationTracker(MemTracker):
    """MemTracker's trace of allocations, without its statistics per module: those refuse a module
    called twice in one pass, as the engine calls each layer's linears once per sub-batch."""

    def _pre_fw_hook(self, module: torch.nn.Module, inputs: Any) -> None:
        pass

    def _post_fw_hook(self, module: torch.nn.Module, inputs: Any, outputs: Any) -> None:
        pass


def plan_activations(
    empty_model: Callable[[], CausalLM],
    kinds: list[AttentionKind],
    device: torch.device,
    tokens: int,
    rows: int,
) -> ActivationPlan:
    """Trace the worst-case iteration on ``device`` of the model ``empty_model()`` builds
    (each layer attending as ``kinds`` says), on fake tensors: nothing is allocated."""
    rows = min(rows, tokens)
    # Under a fake mode already (the CUDA path tested without a GPU) the trace joins it.
    active = torch._C._get_dispatch_mode(torch._C._TorchDispatchModeKey.FAKE)
    fake = contextlib.nullcontext() if active is not None else FakeTensorMode()
    tracker = AllocationTracker()
    with fake:
        model = empty_model()
        tracker.track_external(model)  # so that views of the weights count as weights
        with torch.inference_mode(), tracker:
            _worst_iteration(model, kinds, device, tokens, rows)
    peak = peak_beyond(tracker, device)
    if peak <= 0:
        raise RuntimeError(f"the activation trace saw no allocation on {device}")
    return ActivationPlan(tokens, rows, peak)


def peak_beyond(tracker: MemTracker, device: torch.device) -> int:
    """The tracker's peak on ``device``, less what was there before it (``track_external``: the
    weights and, for a running engine, the pools)."""
    peak = tracker.get_tracker_snapshot("peak").get(device, {})
    before = (_MemRefType.PARAM, _MemRefType.BUFFER, _MemRefType.OTH)
    return int(peak.get("Total", 0) - sum(peak.get(kind, 0) for kind in before))


def _worst_iteration(
    model: CausalLM, kinds: list[AttentionKind], dev: torch.device, tokens: int, rows: int
) -> None:
    ids = torch.zeros(tokens, dtype=torch.long, device=dev)
    x = model.embed(ids)
    rope = model.rotary.at(torch.arange(tokens, device=dev), x.dtype)
    for layer, kind in zip(model.decoder_layers, kinds, strict=True):  # as ModelRunner._sequential
        q, k, v = layer.pre_attention(x, rope)
        out = torch.empty_like(q)
        out[:] = attend_positions(q, k, v, 0, kind)
        x = layer.post_attention(out, x)
    logits = model.compute_logits(x[tokens - rows :])
    sample_rows = [SampleRow(WORST_ROW, [], [], None, []) for _ in range(rows)]
    draw(logits, sample_rows, runtime().generator(dev))
