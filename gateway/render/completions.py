"""OpenAI text_completion rendering: the blocking object and its streamed chunks (same object, new text)."""

from __future__ import annotations

from typing import Any

from gateway.domain import GenerationEvent, GenerationResult, Prompt
from gateway.errors import GatewayError
from gateway.render.openai_common import openai_usage, system_fingerprint

_KEPT_FINISH = {"length", "content_filter"}


def completion_finish_reason(native: str | None) -> str:
    return native if native in _KEPT_FINISH else "stop"


def legacy_logprobs(entries: list[dict[str, Any]] | None, offset: int) -> dict[str, Any]:
    """Engine token entries -> the legacy object; `offset` is where the first token starts in the choice text.

    `top_logprobs[i]` maps each of the top tokens to its logprob and always holds the sampled token too
    (so up to `logprobs + 1` keys, as OpenAI documents).
    """
    tokens: list[str] = []
    token_logprobs: list[float | None] = []
    top: list[dict[str, float | None]] = []
    offsets: list[int] = []
    for entry in entries or ():
        token = entry["token"]
        tokens.append(token)
        token_logprobs.append(entry["logprob"])
        alternatives: dict[str, float | None] = {}
        for alt in entry.get("top_logprobs") or ():  # most likely first: two ids decoding alike keep the best
            alternatives.setdefault(alt["token"], alt["logprob"])
        alternatives.setdefault(token, entry["logprob"])
        top.append(alternatives)
        offsets.append(offset)
        offset += len(token)
    return {"tokens": tokens, "token_logprobs": token_logprobs, "top_logprobs": top, "text_offset": offsets}


class CompletionShape:
    """What the response looks like beyond the engine's output: ids, prompts (for echo), logprobs."""

    def __init__(self, request_id: str, created: int, model: str, prompts: tuple[Prompt, ...], n: int, echo: bool,
                 logprobs: int | None) -> None:
        # the text of each prompt, for echo (which the contract refuses with token-id prompts)
        self.prompts = tuple(p if isinstance(p, str) else "" for p in prompts)
        self.n = n
        self.echo = echo
        self.logprobs = logprobs
        self.request_id = request_id
        self.head = {
            "id": f"cmpl-{request_id}",
            "object": "text_completion",
            "created": created,
            "model": model,
            "system_fingerprint": system_fingerprint(model),
        }

    def prompt_of(self, index: int) -> str:
        return self.prompts[index // self.n]


def render_completion(shape: CompletionShape, result: GenerationResult) -> dict[str, Any]:
    choices = []
    for index in sorted(result.choices):
        c = result.choices[index]
        prefix = shape.prompt_of(index) if shape.echo else ""
        choices.append({
            "index": index,
            "text": prefix + c["text"],
            "logprobs": legacy_logprobs(c["logprobs"], 0) if shape.logprobs is not None else None,
            "finish_reason": completion_finish_reason(c["finish_reason"]),
        })
    return {**shape.head, "choices": choices, "usage": openai_usage(result.prompt_tokens, result.completion_tokens,
                                                                         result.cached_tokens)}


class CompletionStreamRenderer:
    """Model events -> text_completion chunks, one choice per chunk; per-choice echo and text offsets."""

    def __init__(self, shape: CompletionShape, include_usage: bool, continuous_usage: bool = False) -> None:
        self.shape = shape
        self.include_usage = include_usage
        self.continuous_usage = continuous_usage
        self.choice_tokens: dict[int, int] = {}  # completion tokens so far per choice (continuous usage)
        self.started: set[int] = set()
        self.offsets: dict[int, int] = {}  # characters sent so far per choice (legacy `text_offset`)
        self.prompt_tokens: dict[int, int] = {}  # per prompt: each engine request counts its own prompt
        self.cached_tokens: dict[int, int] = {}
        self.completion_tokens = 0

    def _chunk(self, index: int, text: str, logprobs: dict[str, Any] | None, finish: str | None) -> dict[str, Any]:
        chunk = {**self.shape.head, "choices": [
            {"index": index, "text": text, "logprobs": logprobs, "finish_reason": finish}]}
        if self.continuous_usage:
            chunk["usage"] = openai_usage(sum(self.prompt_tokens.values()), sum(self.choice_tokens.values()),
                                          sum(self.cached_tokens.values()))
        return chunk

    def on_event(self, event: GenerationEvent) -> list[dict[str, Any]]:
        index = event.index
        prompt = index // self.shape.n
        self.prompt_tokens[prompt] = max(self.prompt_tokens.get(prompt, 0), event.prompt_tokens)
        self.cached_tokens[prompt] = max(self.cached_tokens.get(prompt, 0), event.cached_tokens)
        self.choice_tokens[index] = max(self.choice_tokens.get(index, 0), event.completion_tokens)
        text = event.text
        if index not in self.started:
            self.started.add(index)
            if self.shape.echo:
                text = self.shape.prompts[prompt] + text
        chunks = []
        if text or event.logprobs:
            logprobs = None
            if self.shape.logprobs is not None:
                logprobs = legacy_logprobs(event.logprobs, self.offsets.get(index, 0))
            self.offsets[index] = self.offsets.get(index, 0) + len(text)
            chunks.append(self._chunk(index, text, logprobs, None))
        if event.finish_reason is not None:
            self.completion_tokens += event.completion_tokens
            chunks.append(self._chunk(index, "", None, completion_finish_reason(event.finish_reason)))
        return chunks

    def usage_chunk(self) -> dict[str, Any] | None:
        if not self.include_usage:
            return None
        prompt = sum(self.prompt_tokens.values())
        cached = sum(self.cached_tokens.values())
        return {**self.shape.head, "choices": [], "usage": openai_usage(prompt, self.completion_tokens, cached)}

    def error_chunk(self, error: GatewayError) -> dict[str, Any]:
        err: dict[str, Any] = {"message": error.message, "type": error.type, "param": error.param,
                               "code": error.code}
        if error.retry_after is not None:
            err["retry_after_s"] = error.retry_after
        choice = {"index": 0, "text": "", "logprobs": None, "finish_reason": None}
        return {**self.shape.head, "choices": [choice], "error": err, "request_id": self.shape.request_id}
