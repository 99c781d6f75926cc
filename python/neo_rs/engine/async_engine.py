"""The engine behind the server: ``LLMEngine`` steps in its own thread; the event loop submits
requests and aborts through a queue and receives each request's outputs on an asyncio queue, so
it never blocks on model work. Tokenization runs on a separate one-thread executor with its own
tokenizer instance (fast tokenizers must not be shared across threads). A failed iteration fails
only its own requests; ``MAX_CONSECUTIVE_STEP_FAILURES`` in a row, or one ``EngineDeadError`` (a
tensor-parallel rank is gone), make the engine fatal (``fatal_error``), and the server then reports
503 and exits non-zero for a supervisor to restart."""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
from collections.abc import AsyncIterator, Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

from neo_rs.config import EngineArgs
from neo_rs.engine.llm_engine import LLMEngine
from neo_rs.engine.sequence import RequestOutput
from neo_rs.engine.stats import IterationStats
from neo_rs.engine.tokenizer import load_tokenizer
from neo_rs.errors import EngineDeadError, EngineStepError, InvalidArgumentError, NeoRsError
from neo_rs.sample.sampling import SamplingParams

log = logging.getLogger(__name__)

# Failed iterations in a row after which the engine is deemed broken (a bad device, corrupt
# weights) rather than unlucky: isolated failures cost only their own requests.
MAX_CONSECUTIVE_STEP_FAILURES = 3


class QueueFull(Exception):
    """More requests wait than ``max_waiting`` allows."""


@dataclass
class _Add:
    request_id: str
    prompt: str | list[int]
    prompt_ids: list[int]
    params: SamplingParams
    cache_salt: str | None
    loop: asyncio.AbstractEventLoop
    outputs: asyncio.Queue[RequestOutput | BaseException]


@dataclass
class _Abort:
    request_id: str


class AsyncEngine:
    def __init__(self, args: EngineArgs, max_waiting: int | None = None) -> None:
        self.args = args
        self.max_waiting = max_waiting
        self.engine: LLMEngine | None = None
        self.ready = threading.Event()
        self.load_error: BaseException | None = None
        self.fatal_error: EngineStepError | None = None
        self.on_fatal: Callable[[], object] | None = None  # called from the engine thread
        self._consecutive_failures = 0
        self._inbox: queue.SimpleQueue[_Add | _Abort] = queue.SimpleQueue()
        self._streams: dict[str, _Add] = {}
        self._num_pending = 0  # submitted, not yet finished (read from the event loop)
        self._tokenize_pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="neo-tokenize")
        self._tokenizer: Any = None
        self.on_step: Callable[[LLMEngine, IterationStats | None, list[RequestOutput]], None] | None = None
        self._stopping = threading.Event()
        self._thread = threading.Thread(target=self._main, name="neo-engine", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def _main(self) -> None:
        try:
            self.engine = LLMEngine(self.args)
            if self.engine.tokenizer is not None:
                self._tokenizer = load_tokenizer(self.engine.model_dir)
        except BaseException as e:  # reported by /health and the CLI (in one line)
            self.load_error = e
            if not isinstance(e, NeoRsError):  # a bug rather than a bad model or argument
                log.exception("the engine failed to load")
            self.ready.set()
            return
        self.ready.set()
        try:
            self._loop(self.engine)
        finally:
            self.engine.shutdown()  # tensor-parallel workers stop with the engine thread

    def _loop(self, engine: LLMEngine) -> None:
        while not self._stopping.is_set():
            if self.fatal_error is None and (dead := engine.dead()) is not None:
                self._step_failed(engine, dead)  # a worker rank is gone: every stream gets the error
            idle = self.fatal_error is not None or not engine.has_unfinished()
            cmds = self._take_commands(block=idle)
            if cmds is None:
                continue
            outputs: list[RequestOutput] = []
            for cmd in cmds:
                if isinstance(cmd, _Add):
                    self._add(engine, cmd)
                else:
                    out = engine.abort(cmd.request_id)
                    outputs += [out] if out is not None else []
            stats = None
            if self.fatal_error is None and engine.has_unfinished():
                try:
                    outputs += engine.step()
                    self._consecutive_failures = 0
                except Exception as e:
                    outputs += self._step_failed(engine, e)  # for the metrics; streams get the error
                stats = engine.last_stats
            # Counted before delivered: a client that has its answer finds it in /metrics.
            if self.on_step is not None:
                self.on_step(engine, stats, outputs)
            for out in outputs:
                self._deliver(out)

    def _step_failed(self, engine: LLMEngine, error: Exception) -> list[RequestOutput]:
        """Fail the requests of the iteration that raised (every open one if the engine could not
        say which); after too many failures in a row, every request, and the engine for good.
        Returns the failed requests' final (aborted) outputs."""
        log.error("an engine iteration failed", exc_info=error)
        if not isinstance(error, EngineStepError):
            error = EngineStepError(
                f"the engine failed ({type(error).__name__}: {error})", list(self._streams)
            )
        self._consecutive_failures += 1
        request_ids = error.request_ids
        if isinstance(error, EngineDeadError) or self._consecutive_failures >= MAX_CONSECUTIVE_STEP_FAILURES:
            log.critical("%d engine iterations failed in a row: giving up", self._consecutive_failures)
            self.fatal_error = error
            request_ids = list(self._streams)
        outputs = []
        for request_id in request_ids:
            out = engine.abort(request_id)
            outputs += [out] if out is not None else []
            stream = self._streams.pop(request_id, None)
            if stream is not None:
                stream.loop.call_soon_threadsafe(stream.outputs.put_nowait, error)
        if self.fatal_error is not None and self.on_fatal is not None:
            self.on_fatal()
        return outputs

    def _take_commands(self, block: bool) -> list[_Add | _Abort] | None:
        """Every queued command; when idle, wait for one (None after a quiet half second)."""
        cmds: list[_Add | _Abort] = []
        try:
            first = self._inbox.get(timeout=0.5) if block else self._inbox.get_nowait()
            while first is not None:
                cmds.append(first)
                first = self._inbox.get_nowait()
        except queue.Empty:
            pass
        return cmds if cmds or not block else None

    def _add(self, engine: LLMEngine, cmd: _Add) -> None:
        if self.fatal_error is not None:  # the engine gave up: answer at once instead of queuing
            cmd.loop.call_soon_threadsafe(cmd.outputs.put_nowait, self.fatal_error)
            return
        try:
            engine.add_request(
                cmd.prompt,
                cmd.params,
                request_id=cmd.request_id,
                prompt_ids=cmd.prompt_ids,
                cache_salt=cmd.cache_salt,
            )
        except BaseException as e:
            cmd.loop.call_soon_threadsafe(cmd.outputs.put_nowait, e)
            return
        self._streams[cmd.request_id] = cmd

    def _deliver(self, out: RequestOutput) -> None:
        stream = self._streams.get(out.request_id)
        if stream is None:
            return
        if out.finished:
            del self._streams[out.request_id]
        stream.loop.call_soon_threadsafe(stream.outputs.put_nowait, out)

    # -- event-loop side -------------------------------------------------------------------

    async def tokenize(self, text: str, add_special_tokens: bool = True) -> list[int]:
        if self._tokenizer is None:
            raise InvalidArgumentError("this model has no tokenizer; send token ids")
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(
            self._tokenize_pool,
            lambda: list(self._tokenizer.encode(text, add_special_tokens=add_special_tokens)),
        )

    async def apply_chat_template(
        self, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None = None
    ) -> str:
        """The prompt of a conversation; ``tools`` reach the model if its template renders them."""
        tok = self._tokenizer
        if tok is None or not getattr(tok, "chat_template", None):
            raise InvalidArgumentError("this model has no chat template")
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(
            self._tokenize_pool,
            lambda: tok.apply_chat_template(
                messages, tools=tools, tokenize=False, add_generation_prompt=True
            ),
        )

    async def compile_grammar(self, params: SamplingParams) -> None:
        """Compile a request's structured output on the tokenizer threads (raises
        ``InvalidArgumentError``), so a bad schema is answered before a stream starts; the engine
        thread then finds it compiled."""
        so = params.structured_outputs
        if so is None:
            return
        assert self.engine is not None
        grammars = self.engine.grammars
        if grammars is None:
            raise InvalidArgumentError("structured outputs need a tokenizer")
        await asyncio.get_running_loop().run_in_executor(self._tokenize_pool, grammars.compile, so)

    def token_text(self, token_id: int) -> str:
        return "" if self._tokenizer is None else str(self._tokenizer.decode([token_id]))

    def check(self, prompt_ids: list[int], params: SamplingParams) -> None:
        """Validate against the model before queuing (raises ``InvalidArgumentError``)."""
        assert self.engine is not None
        self.engine.check_prompt(prompt_ids, params)

    def reserve(self, num_requests: int) -> None:
        """Raise ``QueueFull`` if ``num_requests`` more would overfill the waiting queue."""
        if self.max_waiting is None:
            return
        waiting = self._num_pending + num_requests - self.args.max_num_seqs
        if waiting > self.max_waiting:
            raise QueueFull(f"the waiting queue is full ({self.max_waiting} requests); retry later")

    async def generate(
        self,
        request_id: str,
        prompt: str | list[int],
        prompt_ids: list[int],
        params: SamplingParams,
        cache_salt: str | None = None,
    ) -> AsyncIterator[RequestOutput]:
        """Outputs of one request as they come; leaving early (a disconnect) aborts it."""
        if self._stopping.is_set():
            raise EngineDeadError("the engine is stopped: shutdown() was called", [request_id])
        loop = asyncio.get_running_loop()
        outputs: asyncio.Queue[RequestOutput | BaseException] = asyncio.Queue()
        self._num_pending += 1
        self._inbox.put(_Add(request_id, prompt, prompt_ids, params, cache_salt, loop, outputs))
        finished = False
        try:
            while not finished:
                item = await outputs.get()
                if isinstance(item, BaseException):
                    finished = True
                    raise item
                finished = item.finished
                yield item
        finally:
            self._num_pending -= 1
            if not finished:
                self._inbox.put(_Abort(request_id))

    def abort_all(self) -> None:
        for request_id in list(self._streams):
            self._inbox.put(_Abort(request_id))

    async def stop(self) -> None:
        """End the engine thread after its current iteration (at shutdown, after ``drain``); the
        thread shuts its engine down as it ends."""
        self._stopping.set()
        if self._thread.is_alive():
            await asyncio.get_running_loop().run_in_executor(None, self._thread.join, 30.0)

    async def shutdown(self) -> None:
        """``stop``, then the tokenizer's thread; idempotent. ``async with AsyncEngine(args) as
        engine:`` starts the engine and calls it on leaving."""
        await self.stop()
        self._tokenize_pool.shutdown(wait=True)

    async def __aenter__(self) -> AsyncEngine:
        self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.shutdown()

    async def drain(self, timeout: float) -> bool:
        """Wait until no request is in flight, at most ``timeout`` s; True if it got there."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        while self._num_pending and loop.time() < deadline:
            await asyncio.sleep(0.05)
        return self._num_pending == 0
