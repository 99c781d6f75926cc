"""Rank 0's workers under tensor parallelism. By default the engine (rank 0) starts ranks
1..N-1 itself with torch.multiprocessing (spawn). Launched by ``torchrun`` (or any ``env://``
launcher, which is also the way across nodes), every rank runs the same command and ranks other
than 0 become workers (``run_worker``). Either way rank 0 sends its setup once, then each
iteration's plan once: one broadcast of the plan's arrays, after which every rank applies its swaps
and runs its forward pass over its own heads and pools. Only rank 0 schedules and samples.

Failure: a worker that raises logs its traceback and exits; one that dies closes its sockets, so
rank 0's next collective raises at once. ``TpWorkers.dead`` tells rank 0 between iterations (for
the workers it started), and the engine then stops for good (``EngineDeadError``): the ranks'
collectives can no longer be trusted to line up."""

from __future__ import annotations

import dataclasses
import logging
import os
import socket
import sys
import time
import weakref
from multiprocessing.connection import Connection
from multiprocessing.process import BaseProcess
from types import SimpleNamespace
from typing import TYPE_CHECKING, Any, NoReturn, cast

import torch
import torch.multiprocessing as mp

from neo_rs.config import EngineArgs
from neo_rs.errors import BackendError, InvalidArgumentError
from neo_rs.parallel.group import JOIN_TIMEOUT, TensorParallel, join
from neo_rs.worker import faults
from neo_rs.worker.profiler import profile

if TYPE_CHECKING:
    from neo_rs._core import SchedulerOutput
    from neo_rs.worker.runner import ModelRunner, RunnerSetup

log = logging.getLogger(__name__)

# What the runners read of a plan (``ModelRunner.apply_swaps``, ``execute``, ``AttentionBatch``).
PLAN_FIELDS = (
    "req_ids",
    "num_decodes",
    "num_cpu_decodes",
    "num_host_prefills",
    "sub_batch1_start",
    "input_ids",
    "positions",
    "slot_mapping",
    "query_start_loc",
    "seq_lens",
    "block_tables",
    "sample_rows",
    "swap_out",
    "swap_in",
    "prefill_to_host",
    "cache_to_host",
    "cache_to_device",
)
_STOP_WAIT_S = 10.0


def launched_by_env() -> tuple[int, int] | None:
    """(rank, world size) when an ``env://`` launcher such as torchrun started this process."""
    if not all(k in os.environ for k in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")):
        return None
    return int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])


def rank_threads(size: int) -> int:
    """This rank's equal share of the host's cores (split between the ranks on it,
    ``LOCAL_WORLD_SIZE`` under torchrun), given to torch's intra-op threads."""
    per_rank = max(1, (os.cpu_count() or 1) // int(os.environ.get("LOCAL_WORLD_SIZE", size)))
    torch.set_num_threads(per_rank)
    return per_rank


def budget_threads(args: EngineArgs, size: int) -> EngineArgs:
    """Rank 0: ``rank_threads``, and ``args`` with the CPU attention's share set to the same
    unless ``cpu_threads`` or ``NEO_RS_CPU_THREADS`` says otherwise (the workers get these args)."""
    per_rank = rank_threads(size)
    if args.cpu_threads is None and not os.environ.get("NEO_RS_CPU_THREADS"):
        return dataclasses.replace(args, cpu_threads=per_rank)
    return args


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class TpWorkers:
    """Ranks 1..N-1, seen from rank 0; ``tp`` is rank 0's own place in the group."""

    def __init__(self, setup: RunnerSetup) -> None:
        size = setup.args.tensor_parallel_size
        launch = launched_by_env()
        self.procs: list[BaseProcess] = []
        if launch is not None:  # the launcher started the workers
            if launch != (0, size):
                raise InvalidArgumentError(
                    f"this process is rank {launch[0]} of {launch[1]} (RANK, WORLD_SIZE); the engine runs "
                    f"on rank 0 of tensor_parallel_size {size} (python -m neo_rs.serve makes the other "
                    "ranks workers)"
                )
            init_method, joining = "env://", []
        else:
            init_method = f"tcp://127.0.0.1:{_free_port()}"
            joining = self._spawn(size, init_method)
        # However rank 0 goes away, the workers it started go with it.
        self._finalizer = weakref.finalize(self, _terminate, self.procs)
        self._closed = False
        try:
            self._await_started(joining)
            self.tp, _ = join(0, size, init_method, setup)
        except BaseException:
            self._finalizer()
            raise

    def _spawn(self, size: int, init_method: str) -> list[Connection]:
        """Start ranks 1..size-1; one pipe from each says it started (pipes, not events: no
        semaphores to leak)."""
        ctx = mp.get_context("spawn")
        pipes = [ctx.Pipe(duplex=False) for _ in range(1, size)]
        self.procs = [
            ctx.Process(
                target=_spawned_worker,
                args=(r, size, init_method, sender),
                name=f"neo-tp-rank{r}",
                daemon=True,
            )
            for r, (_, sender) in enumerate(pipes, start=1)
        ]
        for p in self.procs:
            p.start()
        return [receiver for receiver, _ in pipes]

    def _await_started(self, joining: list[Connection]) -> None:
        """Wait until every worker is about to join the group; one that exits first (it could not
        even import) is an error now, not a rendezvous timeout later."""
        deadline = time.monotonic() + JOIN_TIMEOUT.total_seconds()
        while not all(c.poll() for c in joining):
            if (reason := self.dead()) is not None:
                raise BackendError(
                    f"{reason} before joining the group; a script that starts an engine with "
                    "tensor_parallel_size > 1 must guard its top level with if __name__ == '__main__': "
                    "(the workers are spawned and import the main module)"
                )
            if time.monotonic() > deadline:
                raise BackendError("the tensor-parallel workers did not start in time")
            time.sleep(0.05)

    def dead(self) -> str | None:
        """Why the group is broken (a worker exited), or None while every worker runs."""
        for rank, p in enumerate(self.procs, start=1):
            if p.exitcode is not None:
                return f"tensor-parallel rank {rank} exited with code {p.exitcode} (its log says why)"
        return None

    def step(self, plan: SchedulerOutput) -> None:
        """Send this iteration's plan to every worker (they then run it with rank 0)."""
        self.tp.broadcast(("step", {name: getattr(plan, name) for name in PLAN_FIELDS}))

    def profile(self, max_tokens: int, max_model_len: int) -> None:
        """Have the workers run the start-up profile beside rank 0 (its linear stages all-reduce)."""
        self.tp.broadcast(("profile", max_tokens, max_model_len))

    def kill(self) -> None:
        """Terminate the workers at once: after a failed iteration their collectives are out of
        step with rank 0's, so asking them would hang (workers a launcher started see the group
        close and exit)."""
        self._finalizer()
        self._close()

    def stop(self) -> None:
        """Stop the workers (asked nicely while the group works, terminated otherwise)."""
        if self._closed:
            return
        if self.dead() is None:
            try:
                self.tp.broadcast(("stop",))
            except RuntimeError as e:  # a worker died meanwhile
                log.warning("could not ask the tensor-parallel workers to stop: %s", e)
        for p in self.procs:
            p.join(_STOP_WAIT_S)
        self._finalizer()
        self._close()

    def _close(self) -> None:
        self._closed = True
        self.tp.close()


def _terminate(procs: list[BaseProcess]) -> None:
    for p in procs:
        if p.is_alive():
            p.terminate()
    for p in procs:
        p.join(_STOP_WAIT_S)


def _spawned_worker(rank: int, size: int, init_method: str, started: Connection) -> None:
    logging.basicConfig(
        level=logging.INFO, format=f"%(asctime)s %(levelname)s [rank {rank}] %(name)s: %(message)s"
    )
    started.send(True)
    run_worker(rank, size, init_method)


def run_worker(rank: int, size: int, init_method: str) -> NoReturn:
    """Be rank ``rank``'s worker until rank 0 says stop, then exit (1 if anything failed)."""
    try:
        tp, setup = join(rank, size, init_method)
        rank_threads(size)  # the CPU attention's share came in rank 0's args
        runner = setup.build(tp)
        faults.inject(runner, rank)
        _serve(runner, tp)
        tp.close()
    except BaseException:
        log.exception("tensor-parallel rank %d failed", rank)
        sys.stderr.flush()
        os._exit(1)  # no atexit work: rank 0 sees the closed sockets at once
    sys.exit(0)  # a normal exit, whose clean-up releases what the process holds


def _serve(runner: ModelRunner, tp: TensorParallel) -> None:
    """Run rank 0's commands until it says stop."""
    while True:
        cmd: tuple[Any, ...] = tp.broadcast()
        if cmd[0] == "step":
            plan = cast("SchedulerOutput", SimpleNamespace(**cmd[1]))  # the fields the runner reads
            runner.apply_swaps(plan)
            runner.execute(plan)
        elif cmd[0] == "profile":
            profile(runner, cmd[1], cmd[2], show_progress=False)
        elif cmd[0] == "stop":
            return
        else:
            raise RuntimeError(f"unknown command {cmd[0]!r} from rank 0")
