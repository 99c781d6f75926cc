"""Sparse MLP layers (Mixtral, Qwen3-MoE): a router picks ``top_k`` of ``num_experts`` SwiGLU
experts per token, and the token's output is their weighted sum.

The experts are stacked (``w_gate_up`` ``[experts, 2 I, H]``, ``w_down`` ``[experts, H, I]``).
On CUDA one grouped GEMM per projection covers them all (``cuda/fused_moe.py``), with nothing read
back to the host. On the CPU the (token, slot) pairs are grouped by expert with one sort, and each
active expert runs one GEMM over its group (its row count read on the host, which costs nothing
there), on weights prepacked for oneDNN like every other linear (``packed.py``). Neither path
loops over tokens or multiplies an expert by rows it was not chosen for.

Under tensor parallelism each rank holds every expert's share of the intermediate columns, and one
all-reduce per layer joins them, as for the dense MLP."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from neo_rs.config import MoeConfig
from neo_rs.parallel.group import TensorParallel

# An expert's two projections as callables (plain or oneDNN-packed linears).
Projection = nn.Module


class SparseMoe(nn.Module):
    def __init__(self, hidden: int, moe: MoeConfig, tp: TensorParallel) -> None:
        super().__init__()
        self.tp, self.top_k, self.norm_topk_prob = tp, moe.top_k, moe.norm_topk_prob
        self.num_experts = experts = moe.num_experts
        size = moe.intermediate_size
        self.router = nn.Linear(hidden, experts, bias=False)
        self.w_gate_up = nn.Parameter(torch.empty(experts, 2 * size, hidden))
        self.w_down = nn.Parameter(torch.empty(experts, hidden, size))
        # Per expert (gate/up, down) as oneDNN-packed linears once ``pack`` ran (CPU, bf16).
        self.packed: list[tuple[Projection, Projection]] | None = None

    def pack(self, linear: type[nn.Module], rows: int) -> None:
        """Prepack every expert's projections with ``linear`` (``packed.PackedLinear``); the
        stacked weights are then dropped, as a packed linear drops its plain weight."""

        def wrap(w: torch.Tensor) -> nn.Module:
            plain = nn.Linear(w.shape[1], w.shape[0], bias=False, device="meta")
            plain.weight = nn.Parameter(w, requires_grad=False)
            return linear(plain, rows)

        self.packed = [(wrap(gu), wrap(d)) for gu, d in zip(self.w_gate_up, self.w_down, strict=True)]
        self.w_gate_up = nn.Parameter(self.w_gate_up.new_empty(0), requires_grad=False)
        self.w_down = nn.Parameter(self.w_down.new_empty(0), requires_grad=False)

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Each token's experts ``[T, top_k]`` and their weights (float32): the softmax over
        all experts' logits, the ``top_k`` largest, renormalised when the model says so."""
        probs = self.router(x).float().softmax(dim=-1)
        weights, experts = probs.topk(self.top_k, dim=-1)
        if self.norm_topk_prob:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        return experts, weights

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        experts, weights = self.route(x)
        if x.device.type == "cuda":
            from neo_rs.model.cuda.fused_moe import fused_moe  # noqa: PLC0415 (needs Triton)

            return self.tp.all_reduce(fused_moe(x, self.w_gate_up, self.w_down, experts, weights))
        return self.tp.all_reduce(self._grouped(x, experts, weights))

    def _grouped(self, x: torch.Tensor, experts: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        chosen = experts.flatten()
        order = chosen.argsort(stable=True)  # (token, slot) pairs grouped by expert
        tokens = order // self.top_k
        counts = torch.bincount(chosen, minlength=self.num_experts).tolist()
        rows = x[tokens]
        out = torch.empty_like(rows)
        start = 0
        for e, n in enumerate(counts):
            if n:
                group = rows[start : start + n]
                if self.packed is not None:
                    gate_up, down = self.packed[e]
                    gate, up = gate_up(group).chunk(2, dim=-1)
                    out[start : start + n] = down(F.silu(gate) * up)
                else:
                    gate, up = F.linear(group, self.w_gate_up[e]).chunk(2, dim=-1)
                    out[start : start + n] = F.linear(F.silu(gate) * up, self.w_down[e])
                start += n
        scaled = (out.float() * weights.flatten()[order, None]).to(x.dtype)
        return torch.zeros_like(x).index_add_(0, tokens, scaled)
