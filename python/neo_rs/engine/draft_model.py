"""A draft model for speculative decoding (vLLM's ``{"method": "draft_model", "model": PATH}``): a
small model of the target's vocabulary, run in the same engine on the same device, with a small
KV pool of its own. Before each step the target's scheduler names the decodes whose drafts pay
and how many (``Scheduler.draft_requests``, the draft model's rounds priced in); the draft model
runs that many greedy rounds over them and hands the tokens in (``Scheduler.propose``). The step
then verifies them as it verifies prompt lookup's, wherever the request's KV lives.

The draft model's KV is planned by a Rust scheduler of its own (GPU-only, no prefix caching),
whose requests follow the target's: before drafting, a request's tokens become the target's
(``rewind``: the KV of the tokens both share stays). So after a step the draft model computes
only what the target added (the accepted drafts it had not fed yet, and the token after them) in
its first round, and one token a request in each later round. A request its pool cannot hold is
recomputed later, as any preempted one; requests that stop decoding for a step (swapped, about
to finish) leave it.

Drafts are the draft model's greedy tokens, verified as one-hot proposals: a sampled request
keeps a draft iff the target samples it (``engine/speculation.py``), so outputs keep the
target's distribution; acceptance is what the draft's argmax is worth under it."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path

import torch

from neo_rs._core import Scheduler
from neo_rs.config import EngineArgs, ModelConfig
from neo_rs.cuda_runtime import runtime
from neo_rs.errors import InvalidArgumentError, ModelLoadError
from neo_rs.kv.pools import KvLayout
from neo_rs.model.registry import resolve_model
from neo_rs.sample.sampling import greedy
from neo_rs.speculative_config import SpeculativeConfig
from neo_rs.worker.runner import RunnerSetup

log = logging.getLogger(__name__)

# The draft pool's size at most. Unlike the target's pools it need not hold every request at its
# longest: a request it cannot hold is recomputed, and under that much load drafts seldom pay. (Its
# activations need no room of their own on a GPU: they come and go before the target's forward,
# inside the room the target's pools leave for the target's larger ones.)
DRAFT_KV_BYTES = 1 << 30


def draft_model_dir(
    spec: SpeculativeConfig, args: EngineArgs, target: ModelConfig
) -> tuple[Path, ModelConfig]:
    """The draft model's directory and config; ``InvalidArgumentError`` naming
    ``speculative_config.model`` if it cannot be read or has another vocabulary."""
    assert spec.model is not None
    try:
        path = resolve_model(spec.model, args.dtype)
        cfg = ModelConfig.from_dir(path)
    except (OSError, ValueError) as e:  # ModelLoadError is an OSError
        raise InvalidArgumentError(f"speculative_config.model {spec.model!r} cannot be loaded: {e}") from e
    if cfg.vocab_size != target.vocab_size:
        raise InvalidArgumentError(
            f"speculative_config.model {spec.model!r} has a vocabulary of {cfg.vocab_size} tokens, the "
            f"model {target.vocab_size}: a draft model must share the model's tokenizer"
        )
    return path, cfg


class DraftModel:
    def __init__(
        self,
        spec: SpeculativeConfig,
        args: EngineArgs,
        target: ModelConfig,
        dtype: torch.dtype,
        device: torch.device,
        max_model_len: int,
    ) -> None:
        model_dir, cfg = draft_model_dir(spec, args, target)
        self.max_model_len = min(max_model_len, cfg.max_model_len())
        self.num_speculative_tokens = spec.num_speculative_tokens
        self.target_layers = target.num_layers
        layout = KvLayout(cfg.num_layers, cfg.num_kv_heads, args.block_size, cfg.head_dim, dtype)
        per_seq = -(-self.max_model_len // args.block_size)
        blocks = max(1, min(args.max_num_seqs * per_seq, DRAFT_KV_BYTES // layout.bytes_per_block()))
        # Its own checkpoint's weights (``quantization`` is the target's), one rank, its pool alone.
        own = replace(
            args,
            model=spec.model,
            offload="none",
            num_gpu_blocks=blocks,
            num_cpu_blocks=0,
            enable_prefix_caching=False,
            cuda_graphs=False,
            quantization=None,
            speculative_config=None,
            tensor_parallel_size=1,
        )
        try:
            self.runner = RunnerSetup(own, model_dir, cfg, dtype, device, self.max_model_len).build()
        except ModelLoadError as e:
            raise InvalidArgumentError(f"speculative_config.model {spec.model!r}: {e}") from e
        self.scheduler = Scheduler(
            max_num_seqs=args.max_num_seqs,
            max_num_batched_tokens=args.token_budget,
            max_model_len=self.max_model_len,
            block_size=args.block_size,
            num_gpu_blocks=self.runner.num_gpu_blocks,
            num_cpu_blocks=0,
            kv_group_windows=list(self.runner.kv_groups.windows),
        )
        self.held: set[int] = set()  # the requests its scheduler holds
        log.info("draft model %s: %d KV blocks of its own", spec.model, self.runner.num_gpu_blocks)

    def step(self, target: Scheduler, tokens_of: Callable[[int], list[int]]) -> None:
        """Draft for the decodes ``target`` names, hand it the tokens, and tell it what each
        round cost. ``tokens_of``: a request's tokens so far (prompt and outputs)."""
        requests = target.draft_requests()
        if not requests:
            return
        wanted = {seq_id: n for seq_id, n, _ in requests}
        for seq_id in self.held - wanted.keys():
            self.release(seq_id)
        for seq_id, _, longest in requests:
            self._follow(seq_id, tokens_of(seq_id), longest)
        drafts: dict[int, list[int]] = {seq_id: [] for seq_id in wanted if seq_id in self.held}
        fastest: tuple[float, int] | None = None  # the cheapest round of one token a request
        for i in range(max(wanted.values())):
            if all(len(d) >= wanted[i] for i, d in drafts.items()):
                break
            start = time.perf_counter()
            plan = self.scheduler.schedule()
            if len(plan.req_ids) == 0:  # its requests preempted for room: they draft next time
                self.scheduler.update([], [])
                break
            try:
                # A wait for the device each round: its tokens are the next round's inputs.
                sampled = runtime().read(greedy(self.runner.execute(plan)))
            except BaseException:
                for seq_id in self.scheduler.abort_step():
                    self.held.discard(seq_id)
                raise
            for seq_id, _ in self.scheduler.update(sampled, []):
                self.held.discard(seq_id)  # at the draft model's context: it drafts no further
            for seq_id, token in zip(plan.sample_ids.tolist(), sampled, strict=True):
                if seq_id in drafts and len(drafts[seq_id]) < wanted[seq_id]:
                    drafts[seq_id].append(token)
            ms = (time.perf_counter() - start) * 1e3
            if i > 0 and len(plan.input_ids) == len(sampled) and (fastest is None or ms < fastest[0]):
                fastest = (ms, len(sampled))
        # What the scheduler prices is a draft position: a round of one token a request. The first
        # round also catches up on what the target added; the fastest of the others is the least
        # disturbed by anything else the machine does.
        if fastest is not None:
            target.observe_draft_round(fastest[1], fastest[0] / self.target_layers)
        given = {i: d for i, d in drafts.items() if d}
        target.propose(list(given), [t for d in given.values() for t in d], [len(d) for d in given.values()])

    def _follow(self, seq_id: int, tokens: list[int], longest: int) -> None:
        """The draft scheduler's request ``seq_id`` takes the target's ``tokens``; one that does
        not fit the draft model's context or pool drafts nothing."""
        try:
            if seq_id in self.held:
                self.scheduler.rewind(seq_id, tokens)
            else:
                # Rounds run every request it holds, some past their drafts: room for a round more
                # than the target's longest, so that none ends the request.
                end = min(longest + self.num_speculative_tokens, self.max_model_len)
                self.scheduler.add_request(seq_id, tokens, end - len(tokens))
                self.held.add(seq_id)
        except InvalidArgumentError:
            self.release(seq_id)

    def release(self, seq_id: int) -> None:
        """The target no longer decodes ``seq_id`` (finished, aborted, or not this step)."""
        if seq_id in self.held:
            self.held.discard(seq_id)
            self.scheduler.abort(seq_id)
