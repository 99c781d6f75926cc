"""One process's place in the tensor-parallel group and the collectives the model needs, on
torch.distributed: NCCL for tensors on CUDA, gloo on the CPU, and always a gloo group for the
control plane (rank 0's per-iteration plan). With one rank (``SINGLE_PROCESS``) every collective
is the identity and costs nothing, so the model has one code path."""

from __future__ import annotations

import os
import time
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from neo_rs.cuda_runtime import runtime
from neo_rs.parallel.shards import SINGLE, TpShard

# Joining the group (every rank starts within this of the others) and the longest a rank waits
# on its peers inside one iteration's collectives. A dead peer is noticed at once (its sockets
# close); these bound a peer that hangs.
JOIN_TIMEOUT = timedelta(seconds=120)
DATA_TIMEOUT = timedelta(seconds=300)
# Workers wait for the next plan for as long as the engine idles.
CONTROL_TIMEOUT = timedelta(days=365)


class TensorParallel:
    def __init__(self, shard: TpShard = SINGLE, data: Any = None, control: Any = None) -> None:
        self.shard = shard
        self._data, self._control = data, control
        self.comm_ms = 0.0  # wall time inside the model's collectives, for benches/tp_comm.py

    @property
    def rank(self) -> int:
        return self.shard.rank

    @property
    def size(self) -> int:
        return self.shard.size

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sum ``x`` over the ranks, in place (the row-parallel layers' partial products)."""
        if self.size > 1:
            t = time.perf_counter()
            dist.all_reduce(x, group=self._data)
            self.comm_ms += (time.perf_counter() - t) * 1e3
        return x

    def gather_vocab(self, logits: torch.Tensor, vocab_size: int) -> torch.Tensor:
        """Rank 0: every rank's vocab shard of ``logits`` side by side, ``[rows, vocab_size]``;
        the other ranks get their own shard back (they do not sample)."""
        if self.size == 1:
            return logits
        t = time.perf_counter()
        parts = [torch.empty_like(logits) for _ in range(self.size)] if self.rank == 0 else None
        dist.gather(logits.contiguous(), parts, dst=0, group=self._data)
        self.comm_ms += (time.perf_counter() - t) * 1e3
        return torch.cat(parts, dim=-1)[:, :vocab_size] if parts is not None else logits

    def agree_min(self, n: int) -> int:
        """The smallest of every rank's ``n`` (pool sizes, which must match across ranks)."""
        if self.size == 1:
            return n
        x = torch.tensor([n], dtype=torch.int64)
        dist.all_reduce(x, op=dist.ReduceOp.MIN, group=self._control)
        return int(x.item())

    def broadcast(self, obj: Any = None) -> Any:
        """Rank 0's ``obj`` on every rank (one pickled object: a command and its plan)."""
        box = [obj]
        dist.broadcast_object_list(box, src=0, group=self._control)
        return box[0]

    def close(self) -> None:
        if self.size > 1 and dist.is_initialized():
            dist.destroy_process_group()


SINGLE_PROCESS = TensorParallel()


def rank_device(device: torch.device, rank: int) -> torch.device:
    """Rank ``rank``'s device: its node's GPU number ``LOCAL_RANK`` (or ``rank``) on CUDA, the
    CPU otherwise."""
    if device.type != "cuda":
        return device
    return torch.device("cuda", int(os.environ.get("LOCAL_RANK", rank)))


def join(rank: int, size: int, init_method: str, setup: Any = None) -> tuple[TensorParallel, Any]:
    """Join the group of ``size`` processes at ``init_method`` (``tcp://host:port`` or
    ``env://``) as ``rank``. Rank 0's ``setup`` (what every rank needs to build its runner; its
    ``device`` chooses the tensors' backend) comes back on every rank."""
    dist.init_process_group("gloo", init_method=init_method, rank=rank, world_size=size, timeout=JOIN_TIMEOUT)
    box = [setup]
    dist.broadcast_object_list(box, src=0)
    setup = box[0]
    backend = "gloo"
    if setup.device.type == "cuda":
        backend = runtime().collective_backend()
        runtime().set_device(rank_device(setup.device, rank))  # NCCL's communicator binds to it
    data = dist.new_group(backend=backend, timeout=DATA_TIMEOUT)
    control = dist.new_group(backend="gloo", timeout=CONTROL_TIMEOUT)
    return TensorParallel(TpShard(rank, size), data, control), setup
