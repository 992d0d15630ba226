"""SIE-native generate rendering: blocking JSON (section 2.5) and GenerateChunk SSE events (2.6)."""

from __future__ import annotations

from typing import Any

from gateway.domain import GenerationEvent, GenerationRequest, GenerationResult
from gateway.errors import GatewayError, WorkerError, tokens_used


def _usage(req: GenerationRequest, prompt: int, completion: int) -> dict[str, int]:
    usage = {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}
    if req.images:
        usage["images"] = len(req.images)
    return usage


def render_generate_response(
    req: GenerationRequest, result: GenerationResult, model: str, attempt_id: str
) -> dict[str, Any]:
    choice = result.choices.get(0) or {"text": "", "finish_reason": "stop"}
    return {
        "model": model,
        "text": choice["text"],
        "finish_reason": choice["finish_reason"] or "stop",
        "usage": _usage(req, result.prompt_tokens, result.completion_tokens),
        "attempt_id": attempt_id,
        "ttft_ms": result.ttft_ms,
        "tpot_ms": result.tpot_ms,
    }


class GenerateStreamRenderer:
    def __init__(self, req: GenerationRequest, request_id: str, ttft_ms: float) -> None:
        self.req = req
        self.request_id = request_id
        self.ttft_ms = ttft_ms
        self.seq = 0
        self.tokens_seen = (0, 0)  # (prompt, completion) as the events have reported them so far

    def on_event(self, event: GenerationEvent) -> list[dict[str, Any]]:
        chunks = []
        self.tokens_seen = (max(self.tokens_seen[0], event.prompt_tokens),
                            max(self.tokens_seen[1], event.completion_tokens))
        if event.text or event.logprobs:
            chunk: dict[str, Any] = {"request_id": self.request_id, "seq": self.seq, "text_delta": event.text,
                                     "done": False}
            if self.req.logprobs:
                chunk["logprobs"] = event.logprobs or []
            chunks.append(chunk)
            self.seq += 1
        if event.finish_reason is not None:
            chunks.append({
                "request_id": self.request_id,
                "seq": self.seq,
                "text_delta": "",
                "done": True,
                "finish_reason": event.finish_reason,
                "usage": _usage(self.req, event.prompt_tokens, event.completion_tokens),
                "ttft_ms": self.ttft_ms,
            })
            self.seq += 1
        return chunks

    def usage_chunk(self) -> None:
        return None  # usage rides on the terminal event

    def error_chunk(self, error: GatewayError) -> dict[str, Any]:
        if not isinstance(error, WorkerError):
            # synthesized here (timeouts, transport, a dead model process, shutdown): the contract's shape, seq 0
            return {"request_id": self.request_id, "seq": 0, "text_delta": "", "done": True,
                    "finish_reason": "error", "error": {"code": error.code, "message": error.message}}
        err: dict[str, Any] = {"message": error.message, "param": error.param, "code": error.code}
        if error.code == "RESOURCE_EXHAUSTED" and error.retry_after:
            err["retry_after_s"] = int(error.retry_after)
        # a worker error terminal has the terminal's fields (2.6): its usage is what the request had used
        usage = _usage(self.req, *tokens_used(error, self.tokens_seen))
        return {"request_id": self.request_id, "seq": self.seq, "text_delta": "", "done": True,
                "finish_reason": "error", "error": err, "usage": usage, "ttft_ms": self.ttft_ms}
