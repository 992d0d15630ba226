"""OpenAI chat.completion / chat.completion.chunk rendering (docs/contract.md, "Chat completions: responses")."""

from __future__ import annotations

from typing import Any

from gateway.domain import GenerationEvent, GenerationRequest, GenerationResult
from gateway.errors import GatewayError
from gateway.render.openai_common import openai_usage, system_fingerprint
from gateway.render.tool_holdback import ToolHoldback

_KEPT_FINISH = {"length", "tool_calls", "content_filter", "function_call"}


def chat_finish_reason(native: str | None, has_tool_calls: bool) -> str:
    if has_tool_calls:
        return "tool_calls"  # also for a length-truncated candidate that produced a call
    return native if native in _KEPT_FINISH else "stop"


def _logprobs(entries: list[dict[str, Any]] | None, wanted: bool) -> dict[str, Any] | None:
    if not wanted:
        return None
    return {"content": entries or [], "refusal": None}


def render_chat_completion(
    req: GenerationRequest, result: GenerationResult, request_id: str, created: int, model: str, reasoning: bool
) -> dict[str, Any]:
    choices = []
    for index in sorted(result.choices):
        c = result.choices[index]
        message: dict[str, Any] = {"role": "assistant", "content": c["text"]}
        if c["tool_calls"]:
            message["content"] = None
            message["tool_calls"] = c["tool_calls"]
        elif req.forces_tool_call:
            message["content"] = None  # a forced call cut off before it closed: no call, and no answer either
        if reasoning and req.include_reasoning and c.get("reasoning"):
            message["reasoning_content"] = c["reasoning"]
        choices.append({
            "index": index,
            "message": message,
            "logprobs": _logprobs(c["logprobs"], req.logprobs),
            "finish_reason": chat_finish_reason(c["finish_reason"], bool(c["tool_calls"])),
        })
    return {
        "id": f"chatcmpl-{request_id}",
        "object": "chat.completion",
        "created": created,
        "model": model,
        "system_fingerprint": system_fingerprint(model),
        "choices": choices,
        "usage": openai_usage(result.prompt_tokens, result.completion_tokens, result.cached_tokens),
    }


class ChatStreamRenderer:
    """Turns model events into chat.completion.chunk payloads, tracking per-choice state."""

    def __init__(self, req: GenerationRequest, request_id: str, created: int, model: str, reasoning: bool) -> None:
        self.req = req
        self.request_id = request_id
        self.model = model
        self.reasoning = reasoning and req.include_reasoning
        self.head = {
            "id": f"chatcmpl-{request_id}",
            "object": "chat.completion.chunk",
            "created": created,
            "model": model,
            "system_fingerprint": system_fingerprint(model),
        }
        self.role_sent: set[int] = set()
        # with tools in play, leading text may turn out to be a tool call: hold only that part back
        self.holdback = ToolHoldback() if req.tools and req.tool_choice != "none" else None
        self.prompt_tokens = 0
        self.cached_tokens = 0
        self.completion_tokens = 0

    def _chunk(self, index: int, delta: dict[str, Any], finish: str | None = None,
               logprobs: list[dict[str, Any]] | None = None) -> dict[str, Any]:
        if index not in self.role_sent:
            self.role_sent.add(index)
            delta = {"role": "assistant", **delta}
        wanted = self.req.logprobs and logprobs is not None
        choice = {"index": index, "delta": delta, "logprobs": _logprobs(logprobs, wanted), "finish_reason": finish}
        return {**self.head, "choices": [choice]}

    def on_event(self, event: GenerationEvent) -> list[dict[str, Any]]:
        chunks = []
        self.prompt_tokens = max(self.prompt_tokens, event.prompt_tokens)
        self.cached_tokens = max(self.cached_tokens, event.cached_tokens)
        text = event.text
        if self.holdback is not None:
            text = self.holdback.feed(event.index, text)
        delta: dict[str, Any] = {}
        if text:
            delta["content"] = text
        if self.reasoning and event.reasoning:
            delta["reasoning_content"] = event.reasoning
        if delta or event.logprobs or (event.index not in self.role_sent):
            chunks.append(self._chunk(event.index, delta, logprobs=event.logprobs))
        if event.finish_reason is not None:
            self.completion_tokens += event.completion_tokens
            chunks.extend(self._close(event))
        return chunks

    def _close(self, event: GenerationEvent) -> list[dict[str, Any]]:
        chunks = []
        held = self.holdback.close(event.index) if self.holdback is not None else ""
        if event.tool_calls:
            deltas = [
                {"index": i, "id": call["id"], "type": "function",
                 "function": {"name": call["function"]["name"], "arguments": call["function"]["arguments"]}}
                for i, call in enumerate(event.tool_calls)
            ]
            chunks.append(self._chunk(event.index, {"tool_calls": deltas}))
        elif held and not self.req.forces_tool_call:  # a forced call cut off before it closed is not content
            chunks.append(self._chunk(event.index, {"content": held}))
        finish = chat_finish_reason(event.finish_reason, bool(event.tool_calls))
        chunks.append(self._chunk(event.index, {}, finish))
        return chunks

    def usage_chunk(self) -> dict[str, Any] | None:
        if not (self.req.include_usage and self.req.stream):
            return None
        return {**self.head, "choices": [], "usage": openai_usage(self.prompt_tokens, self.completion_tokens,
                                                                  self.cached_tokens)}

    def error_chunk(self, error: GatewayError) -> dict[str, Any]:
        err: dict[str, Any] = {"message": error.message, "type": error.type, "param": error.param,
                               "code": error.code}
        if error.retry_after is not None:
            err["retry_after_s"] = error.retry_after
        choice = {"index": 0, "delta": {}, "logprobs": None, "finish_reason": None}
        return {**self.head, "choices": [choice], "error": err, "request_id": self.request_id}
