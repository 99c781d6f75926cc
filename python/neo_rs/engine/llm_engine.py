"""The step loop (vLLM's ``LLMEngine``): schedule (Rust) -> swaps and forward (runner) ->
sample -> stop checks -> update (Rust). Requests enter as text or token ids with their
``SamplingParams``; a request with ``n > 1`` runs as ``n`` independent sequences."""

from __future__ import annotations

import gc
import itertools
import logging
import random
import time
import uuid
import weakref
from concurrent.futures import wait
from dataclasses import dataclass
from typing import Any, TypedDict

import torch

from neo_rs._core import Scheduler, SchedulerOutput, peak_kv_blocks
from neo_rs.config import EngineArgs, ModelConfig, resolve_dtype
from neo_rs.cuda_runtime import runtime
from neo_rs.engine.draft_model import DraftModel
from neo_rs.engine.sequence import RequestMetrics, RequestOutput, Sequence
from neo_rs.engine.speculation import Verification
from neo_rs.engine.stats import IterationStats, calibrate
from neo_rs.engine.tokenizer import IncrementalDetokenizer, eos_token_ids, load_tokenizer
from neo_rs.environment import cache_dir, force_speculation, forced_acceptance
from neo_rs.errors import EngineDeadError, EngineStepError, InvalidArgumentError
from neo_rs.model.registry import DEMO_MODEL, resolve_model
from neo_rs.parallel.group import SINGLE_PROCESS, TensorParallel, rank_device
from neo_rs.parallel.shards import TpShard
from neo_rs.sample.sampling import RequestOutputKind, SamplingParams, sample
from neo_rs.sample.structured import Grammars
from neo_rs.worker import faults
from neo_rs.worker.profiler import load_or_profile
from neo_rs.worker.runner import RunnerSetup, resolve_device
from neo_rs.worker.tp_workers import TpWorkers, budget_threads

log = logging.getLogger(__name__)


class _BlockShape(TypedDict):
    """What decides the most KV blocks a request holds (``peak_kv_blocks``), as the scheduler
    takes it."""

    block_size: int
    max_num_batched_tokens: int
    kv_group_windows: list[int | None]


@dataclass
class _Request:
    request_id: str
    prompt: str | None
    prompt_ids: list[int]
    seqs: list[Sequence]
    metrics: RequestMetrics
    num_cached_tokens: int | None = None  # read from the scheduler with its first token

    @property
    def finished(self) -> bool:
        return all(s.finished for s in self.seqs)

    def finish(self, now: float) -> None:
        self.metrics.finished_time = now
        self.metrics.num_generation_tokens = sum(len(s.output_ids) for s in self.seqs)

    @property
    def kind(self) -> RequestOutputKind:
        return self.seqs[0].params.output_kind

    def output(self) -> RequestOutput:
        outputs = [s.output(self.kind) for s in self.seqs]
        return RequestOutput(
            self.request_id,
            self.prompt,
            self.prompt_ids,
            outputs,
            self.finished,
            self.metrics,
            self.num_cached_tokens or 0,
        )


class _Owned:
    """What an engine must give back however it ends (``shutdown`` or garbage collection): rank 0's
    tensor-parallel workers with their process group, the grammar worker's threads, and torch's
    intra-op thread count as it found it (the CPU kernel and a rank's share of the cores set it
    for the process). The pools and the CPU kernel's threads go with the runner."""

    def __init__(self) -> None:
        self.workers: TpWorkers | None = None
        self.grammars: Grammars | None = None
        self.torch_threads = torch.get_num_threads()

    def release(self) -> None:
        torch.set_num_threads(self.torch_threads)
        if self.workers is not None:
            self.workers.stop()
            self.workers = None
        if self.grammars is not None:
            self.grammars.close()
            self.grammars = None


def _collected(owned: _Owned) -> None:
    log.warning(
        "an LLMEngine was garbage-collected without shutdown(): its workers are stopped now; "
        "call shutdown(), or use `with LLM(...) as llm:`"
    )
    owned.release()


class LLMEngine:
    def __init__(self, args: EngineArgs) -> None:
        args.validate()
        self._closed = False
        self.drafter: DraftModel | None = None
        if args.model in (None, DEMO_MODEL):
            log.warning("using the built-in demo model: its weights are RANDOM")
        self.model_dir = model_dir = resolve_model(args.model, args.dtype)
        self.model_config = cfg = ModelConfig.from_dir(model_dir)
        self.device = resolve_device(args.device)
        cuda = runtime().capability(self.device) if self.device.type == "cuda" else None
        self.dtype = resolve_dtype(args.dtype, cfg.torch_dtype, cuda)
        limit = cfg.max_model_len()
        if args.max_model_len is not None and args.max_model_len > limit:
            raise InvalidArgumentError(
                f"max_model_len {args.max_model_len} exceeds the model's context of {limit} tokens"
            )
        self.max_model_len = args.max_model_len or limit
        self.max_num_seqs = args.max_num_seqs
        self.workers: TpWorkers | None = None
        tp = SINGLE_PROCESS
        if args.tensor_parallel_size > 1:
            TpShard(0, args.tensor_parallel_size).check(cfg)
            args = budget_threads(args, args.tensor_parallel_size)
        setup = RunnerSetup(args, model_dir, cfg, self.dtype, self.device, self.max_model_len)
        # From here on the engine holds processes, threads and memory: given back by shutdown(),
        # or by this finalizer if the engine is dropped without it.
        self._owned = _Owned()
        self._finalizer = weakref.finalize(self, _collected, self._owned)
        self._finalizer.atexit = False  # at exit they go anyway, with no warning needed
        try:
            if args.tensor_parallel_size > 1:
                self.device = rank_device(self.device, 0)
                self.workers = self._owned.workers = TpWorkers(setup)
                tp = self.workers.tp
            self._build(setup, tp)
        except BaseException:
            self.shutdown()
            raise

    def _build(self, setup: RunnerSetup, tp: TensorParallel) -> None:
        """The runner (rank 0's under tensor parallelism), the tokenizer and the scheduler."""
        args, model_dir, cfg = setup.args, self.model_dir, self.model_config
        spec = args.speculation
        # Before the model: on a GPU its pool is sized from the memory the draft model leaves.
        self.drafter = (
            DraftModel(spec, args, cfg, self.dtype, self.device, self.max_model_len)
            if spec is not None and spec.method == "draft_model"
            else None
        )
        self.runner = setup.build(tp)
        self.tokenizer = None if args.skip_tokenizer_init else load_tokenizer(model_dir)
        self.eos_ids = eos_token_ids(model_dir, self.tokenizer)
        self.grammars = self._owned.grammars = (
            None if self.tokenizer is None else Grammars(self.tokenizer, cfg.vocab_size, self.eos_ids)
        )
        self._block_shape = _BlockShape(
            block_size=args.block_size,
            max_num_batched_tokens=args.token_budget,
            kv_group_windows=list(self.runner.kv_groups.windows),
        )
        self.scheduler = Scheduler(
            max_num_seqs=args.max_num_seqs,
            max_model_len=self.max_model_len,
            **self._block_shape,
            num_gpu_blocks=self.runner.num_gpu_blocks,
            num_cpu_blocks=self.runner.num_cpu_blocks,
            offload=args.offload,
            transfer_bytes_per_decode=self.runner.transfer_bytes_per_decode(),
            kv_bytes_per_token=self.runner.kv_bytes_per_token(),
            force_pipeline=args.neo_force_pipeline,
            enable_prefix_caching=args.enable_prefix_caching,
            num_cpu_prefix_blocks=self.runner.num_cpu_prefix_blocks,
            speculation=spec.scheduler_args(force_speculation()) if spec is not None else None,
        )
        self._pool_blocks = [("device", self.runner.num_gpu_blocks)]
        if args.offload != "none":  # the host pool holds whole requests too
            self._pool_blocks.append(("host", self.runner.num_cpu_blocks))
        if args.offload == "neo" or args.speculation is not None:
            # NEO's policy and the price of drafts both read the measured stage times.
            budget = args.token_budget
            on_profile = self.workers.profile if self.workers is not None else None
            load_or_profile(self.runner, budget, self.max_model_len, cache_dir(), on_profile).apply(
                self.scheduler
            )
        faults.inject(self.runner, 0)
        self.last_stats: IterationStats | None = None
        self.generator = runtime().generator(self.device).manual_seed(args.seed)
        p = forced_acceptance()
        self._force = (p, random.Random(args.seed)) if p is not None and spec is not None else None
        self._requests: dict[str, _Request] = {}
        self._seqs: dict[int, tuple[Sequence, _Request]] = {}
        self._seq_ids = itertools.count()

    # -- requests ---------------------------------------------------------------------------

    def tokenize(self, prompt: str, add_special_tokens: bool = True) -> list[int]:
        if self.tokenizer is None:
            raise InvalidArgumentError("this engine has no tokenizer (skip_tokenizer_init); pass token ids")
        return list(self.tokenizer.encode(prompt, add_special_tokens=add_special_tokens))

    def check_prompt(self, prompt_ids: list[int], params: SamplingParams) -> int:
        """Validate a prompt against the model; returns the request's max_tokens."""
        n = len(prompt_ids)
        if n == 0:
            raise InvalidArgumentError("the prompt is empty")
        vocab = self.model_config.vocab_size
        if not all(isinstance(t, int) and 0 <= t < vocab for t in prompt_ids):
            raise InvalidArgumentError(f"prompt token ids must be integers in [0, {vocab})")
        if params.logit_bias and max(params.logit_bias) >= vocab:
            raise InvalidArgumentError(f"logit_bias token ids must be below the vocabulary size {vocab}")
        if params.n > self.max_num_seqs:
            raise InvalidArgumentError(
                f"n must be at most max_num_seqs ({self.max_num_seqs}), got {params.n}"
            )
        if n >= self.max_model_len:
            raise InvalidArgumentError(
                f"the prompt has {n} tokens, but the model's context is {self.max_model_len} "
                "(leaving no room to generate)"
            )
        max_tokens = params.max_tokens if params.max_tokens is not None else self.max_model_len - n
        if n + max_tokens > self.max_model_len:
            raise InvalidArgumentError(
                f"prompt ({n} tokens) + max_tokens ({max_tokens}) exceeds "
                f"the model's context of {self.max_model_len}"
            )
        # The scheduler refuses a request that could never fit its pools (as it is added, on the
        # engine's thread); said here, a server answers 400 before a stream has begun.
        need = peak_kv_blocks(n + max_tokens - 1, **self._block_shape)
        for pool, blocks in self._pool_blocks:
            if need > blocks:
                raise InvalidArgumentError(
                    f"the prompt ({n} tokens) and max_tokens ({max_tokens}) need {need} KV blocks, but "
                    f"the {pool} pool has {blocks}: lower max_tokens, or give the engine more KV memory"
                )
        return max_tokens

    def add_request(
        self,
        prompt: str | list[int],
        params: SamplingParams | None = None,
        request_id: str | None = None,
        prompt_ids: list[int] | None = None,
        cache_salt: str | None = None,
    ) -> str:
        """Queue a request (text, or token ids); raises ``InvalidArgumentError`` before queuing
        anything. ``cache_salt`` (vLLM's): the request shares prefix-cache blocks only with
        requests of the same salt, so one tenant cannot learn another's prompts from timing (an
        empty salt is an ``InvalidArgumentError`` from the scheduler)."""
        self._check_open()
        params = params or SamplingParams()
        request_id = request_id or uuid.uuid4().hex
        if request_id in self._requests:
            raise InvalidArgumentError(f"request id {request_id!r} is already in use")
        text = prompt if isinstance(prompt, str) else None
        if prompt_ids is None:
            prompt_ids = self.tokenize(prompt) if isinstance(prompt, str) else list(prompt)
        max_tokens = self.check_prompt(prompt_ids, params)
        so = params.structured_outputs
        matchers: list[Any] = [None] * params.n
        if so is not None:
            if self.grammars is None:
                raise InvalidArgumentError("structured outputs need a tokenizer (skip_tokenizer_init is set)")
            matchers = self.grammars.acquire(so, params.n)  # a bad grammar fails before anything is queued
        req = _Request(request_id, text, prompt_ids, [], RequestMetrics(arrival_time=time.monotonic()))
        for i in range(params.n):
            gen = None
            if params.seed is not None:
                gen = runtime().generator(self.device).manual_seed(params.seed + i)
            detok = None
            if self.tokenizer is not None:
                detok = IncrementalDetokenizer(self.tokenizer, prompt_ids, params.skip_special_tokens)
            seq = Sequence(next(self._seq_ids), i, params, prompt_ids, self.eos_ids, gen, detok, matchers[i])
            req.seqs.append(seq)
        added: list[int] = []
        try:
            for seq in req.seqs:
                self.scheduler.add_request(seq.seq_id, prompt_ids, max_tokens, cache_salt)
                added.append(seq.seq_id)
        except Exception:
            for seq_id in added:  # all n sequences or none
                self.scheduler.abort(seq_id)
            for seq in req.seqs:
                self._release(seq)
            raise
        for seq in req.seqs:
            self._seqs[seq.seq_id] = (seq, req)
        self._requests[request_id] = req
        return request_id

    def abort(self, request_id: str) -> RequestOutput | None:
        """Stop a request now and free its KV blocks; its final output, or None if unknown."""
        self._check_open()
        req = self._requests.pop(request_id, None)
        if req is None:
            return None
        for seq in req.seqs:
            self._seqs.pop(seq.seq_id, None)
            self._release(seq)
            if not seq.finished:
                self.scheduler.abort(seq.seq_id)
                seq.finish_reason = "abort"
        req.finish(time.monotonic())
        return req.output()

    def _release(self, seq: Sequence) -> None:
        """Drop a finished or aborted sequence's grammar matcher and draft-model KV."""
        if self.drafter is not None:
            self.drafter.release(seq.seq_id)
        if seq.matcher is not None and self.grammars is not None:
            seq.matcher = None
            self.grammars.release()

    def has_unfinished(self) -> bool:
        return bool(self._requests)

    def dead(self) -> EngineDeadError | None:
        """Why this engine can no longer run (shut down, or a tensor-parallel rank is gone), else
        None."""
        if self._closed:
            reason: str | None = "shutdown() was called"
        else:
            reason = self.workers.dead() if self.workers is not None else None
        if reason is None:
            return None
        return EngineDeadError(f"the engine is stopped: {reason}", list(getattr(self, "_requests", ())))

    def _check_open(self) -> None:
        """After shutdown() nothing is left to queue or free requests in. (An engine whose rank
        died still takes requests and aborts, so that callers can clean up; ``step`` raises.)"""
        if self._closed and (dead := self.dead()) is not None:
            raise dead

    def shutdown(self) -> None:
        """Give back everything the engine holds: rank 0's tensor-parallel workers and their
        process group, both KV pools (pinned buffers too), the CPU kernel's threads and the
        grammar worker. Idempotent; the engine raises ``EngineDeadError`` afterwards. An engine
        collected without it does the same, with a warning."""
        if self._closed:
            return
        self._closed = True
        self._finalizer.detach()
        self._owned.release()
        self.workers = None
        self.drafter = None  # its pool
        for name in ("runner", "scheduler"):  # the pools, and the CPU kernel with its threads
            if hasattr(self, name):
                delattr(self, name)
        gc.collect()  # what held them in reference cycles goes now, not at some later collection
        if self.device.type == "cuda":
            runtime().empty_cache()  # back to the driver, as after vLLM's shutdown

    # -- the step loop ----------------------------------------------------------------------

    def step(self) -> list[RequestOutput]:
        """One iteration; outputs of every request that got a token or finished."""
        self.last_stats = None
        if (dead := self.dead()) is not None:
            raise dead
        if self.drafter is not None:
            self._draft()
        plan = self.scheduler.schedule()
        if len(plan.req_ids) == 0:
            self.scheduler.update([], [])
            return []
        start = time.perf_counter()
        now = time.monotonic()
        for seq_id in plan.req_ids.tolist():
            metrics = self._seqs[seq_id][1].metrics
            if metrics.first_scheduled_time is None:
                metrics.first_scheduled_time = now
        masks = None
        try:
            row_seqs = [self._seqs[i][0] for i in plan.sample_ids.tolist()]
            verify = Verification.of(plan, row_seqs)
            seqs = verify.seqs
            # The grammars' masks for this step's tokens are computed while the model runs.
            masks = self.grammars.start_masks(verify.constrained()) if self.grammars else None
            if self.workers is not None:
                self.workers.step(plan)
            self.runner.apply_swaps(plan)
            logits = self.runner.execute(plan)
            mask = masks.result() if masks is not None else None
            result = sample(logits, verify.rows, self.generator, mask)
            for s in seqs:  # read before update() lets a finished request go
                req = self._seqs[s.seq_id][1]
                if req.num_cached_tokens is None:
                    req.num_cached_tokens = self.scheduler.num_cached_tokens(s.seq_id)
            tokens, counts, stopped = verify.emit(result, self._force)
            finished = self.scheduler.update(tokens, stopped, counts if verify.num_drafted else None)
        except BaseException as e:
            if masks is not None:
                wait([masks])  # the worker reads the matchers the failure is about to drop
            failure = self._fail_step(e)
            if not isinstance(e, Exception):  # KeyboardInterrupt and the like go on as they are
                raise
            raise failure from e
        self._account(plan, (time.perf_counter() - start) * 1e3, verify)
        now = time.monotonic()
        touched: dict[str, _Request] = {}
        for s in seqs:
            req = self._seqs[s.seq_id][1]
            touched[req.request_id] = req
            if req.metrics.first_token_time is None:
                req.metrics.first_token_time = s.first_token_time
        for seq_id, reason in finished:
            seq, req = self._seqs.pop(seq_id)
            seq.finish_reason = reason
            self._release(seq)
            touched[req.request_id] = req
        outputs = []
        for req in touched.values():
            if req.finished:
                req.finish(now)
                del self._requests[req.request_id]
            elif req.kind is RequestOutputKind.FINAL_ONLY:
                continue
            outputs.append(req.output())
        return outputs

    def _draft(self) -> None:
        """The draft model's tokens for this step's decodes. Where it fails, the step does:
        the requests it drafted for are aborted (the scheduler holds nothing half-done)."""
        assert self.drafter is not None
        try:
            self.drafter.step(self.scheduler, lambda i: self._seqs[i][0].token_ids())
        except Exception as e:
            wanted = [i for i, _, _ in self.scheduler.draft_requests() if i in self._seqs]
            ids = {self._seqs[i][1].request_id for i in wanted}
            for request_id in ids:
                self.abort(request_id)
            raise EngineStepError(f"the draft model failed ({type(e).__name__}: {e})", sorted(ids)) from e

    def _fail_step(self, cause: BaseException) -> EngineStepError:
        """The iteration failed between ``schedule`` and ``update``: abort every request it ran
        or swapped (their KV may be half written), freeing their blocks in both pools. Under
        tensor parallelism the ranks' collectives no longer line up: the workers are stopped,
        every request is aborted, and the engine is dead."""
        self.runner.discard_pending()
        request_ids = []
        aborted = self.scheduler.abort_step()
        if self.workers is not None:
            self.workers.kill()
            dead = self.dead()
            reason = dead.args[0] if dead is not None else "the engine is stopped"
            for request_id in list(self._requests):
                self.abort(request_id)
            return EngineDeadError(f"{reason}; the iteration failed ({type(cause).__name__}: {cause})", [])
        for seq_id in aborted:
            entry = self._seqs.get(seq_id)
            if entry is not None and entry[1].request_id not in request_ids:
                request_ids.append(entry[1].request_id)
        for request_id in request_ids:
            self.abort(request_id)
        return EngineStepError(f"the iteration failed ({type(cause).__name__}: {cause})", request_ids)

    def _account(self, plan: SchedulerOutput, iteration_ms: float, verify: Verification) -> None:
        times, num_layers = self.runner.last_times, self.model_config.num_layers
        calibrate(self.scheduler, plan, times, num_layers)
        stats = IterationStats.build(plan, times, self.scheduler, num_layers, iteration_ms)
        stats.num_drafts = verify.num_drafted
        stats.num_draft_tokens = verify.num_draft_tokens
        stats.accepted_per_position = verify.accepted_per_position()
        self.last_stats = stats
