"""The offline API (vLLM's ``LLM``): build an engine, push a batch of prompts or conversations
through it, return one ``RequestOutput`` per prompt in input order."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence as Seq
from typing import Any

from tqdm import tqdm

from neo_rs.config import EngineArgs
from neo_rs.engine.llm_engine import LLMEngine
from neo_rs.engine.sequence import RequestOutput
from neo_rs.errors import InvalidArgumentError
from neo_rs.sample.sampling import RequestOutputKind, SamplingParams

Prompt = str | list[int]
# vLLM's prompt dicts: {"prompt": text} (TextPrompt) or {"prompt_token_ids": ids} (TokensPrompt).
PromptDict = dict[str, Any]
Message = dict[str, Any]
_PROMPT_KEYS = ("prompt", "prompt_token_ids")


def _from_dict(prompt: PromptDict) -> Prompt:
    unknown = sorted(set(prompt) - set(_PROMPT_KEYS))
    if unknown:
        raise InvalidArgumentError(f"unsupported prompt field(s): {', '.join(unknown)}")
    given = [k for k in _PROMPT_KEYS if k in prompt]
    if len(given) != 1:
        raise InvalidArgumentError("a prompt dict needs exactly one of 'prompt' or 'prompt_token_ids'")
    value = prompt[given[0]]
    want = str if given[0] == "prompt" else list
    if not isinstance(value, want):
        raise InvalidArgumentError(f"'{given[0]}' must be a {want.__name__}")
    return value


class LLM:
    """``LLM(model=DIR | FILE.gguf | built-in name, dtype=..., max_num_seqs=..., num_gpu_blocks=... |
    gpu_memory_utilization=..., block_size=...)``; with no model, the demo model (random weights)."""

    def __init__(self, model: str | None = None, **kwargs: Any) -> None:
        self.engine = LLMEngine(EngineArgs(model=model, **kwargs))

    def shutdown(self) -> None:
        """Free the engine's workers, pools and threads (``LLMEngine.shutdown``); idempotent.
        ``with LLM(...) as llm:`` calls it on leaving the block."""
        self.engine.shutdown()

    def __enter__(self) -> LLM:
        return self

    def __exit__(self, *exc: object) -> None:
        self.shutdown()

    def get_tokenizer(self) -> Any:
        return self.engine.tokenizer

    def generate(
        self,
        prompts: Prompt | PromptDict | Seq[Prompt | PromptDict],
        sampling_params: SamplingParams | Seq[SamplingParams] | None = None,
        use_tqdm: bool = True,
    ) -> list[RequestOutput]:
        """Text, token ids or vLLM prompt dicts, one or a list; outputs in input order."""
        if isinstance(prompts, str | dict) or (
            isinstance(prompts, list) and prompts and isinstance(prompts[0], int)
        ):
            prompts = [prompts]  # type: ignore[list-item]
        items = [(_from_dict(p) if isinstance(p, dict) else p, None) for p in prompts]
        return self._run(items, sampling_params, use_tqdm)  # type: ignore[arg-type]

    def chat(
        self,
        messages: list[Message] | list[list[Message]],
        sampling_params: SamplingParams | Seq[SamplingParams] | None = None,
        use_tqdm: bool = True,
        add_generation_prompt: bool = True,
        tools: list[dict[str, Any]] | None = None,
    ) -> list[RequestOutput]:
        """One conversation (a list of ``{"role", "content"}``) or several, through the chat
        template; ``tools`` (OpenAI's tool objects) are passed to it, as vLLM's ``LLM.chat`` does."""
        tok = self.engine.tokenizer
        if tok is None or not getattr(tok, "chat_template", None):
            raise InvalidArgumentError("this model has no chat template")
        conversations = [messages] if messages and isinstance(messages[0], dict) else messages
        items: list[tuple[Prompt, list[int] | None]] = []
        for conv in conversations:
            text = tok.apply_chat_template(
                conv, tools=tools, tokenize=False, add_generation_prompt=add_generation_prompt
            )
            items.append((text, self.engine.tokenize(text, add_special_tokens=False)))
        return self._run(items, sampling_params, use_tqdm)

    def _run(
        self,
        items: list[tuple[Prompt, list[int] | None]],
        sampling_params: SamplingParams | Seq[SamplingParams] | None,
        use_tqdm: bool,
    ) -> list[RequestOutput]:
        if sampling_params is None or isinstance(sampling_params, SamplingParams):
            params = [sampling_params or SamplingParams()] * len(items)
        else:
            params = list(sampling_params)
            if len(params) != len(items):
                raise InvalidArgumentError(f"{len(params)} sampling params for {len(items)} prompts")
        # Only the finished outputs are returned: none is built before (as vLLM's LLM does).
        params = [dataclasses.replace(p, output_kind=RequestOutputKind.FINAL_ONLY) for p in params]
        ids: list[str] = []
        try:
            for (prompt, prompt_ids), p in zip(items, params, strict=True):
                ids.append(self.engine.add_request(prompt, p, prompt_ids=prompt_ids))
        except BaseException:
            for rid in ids:  # all or nothing: a bad prompt queues none of the batch
                self.engine.abort(rid)
            raise
        done: dict[str, RequestOutput] = {}
        with tqdm(total=len(ids), desc="Generating", unit="req", disable=not use_tqdm) as bar:
            try:
                while len(done) < len(ids):
                    for out in self.engine.step():
                        if out.finished:
                            done[out.request_id] = out
                            bar.update(1)
            except BaseException:
                for rid in ids:
                    self.engine.abort(rid)
                raise
        return [done[rid] for rid in ids]
