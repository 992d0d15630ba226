"""OpenAI Response objects (`object: "response"`): the echoed request, output items, usage, status.

One `ResponseShape` per request fixes every id up front (response, item ids), so the streamed events and
the final object can only agree on them; the stream renderer (responses_stream.py) builds on it.
"""

from __future__ import annotations

from typing import Any

from gateway.contracts.responses import ResponsesRequest
from gateway.domain import GenerationResult
from gateway.errors import GatewayError, worker_error


def responses_usage(prompt: int, completion: int, cached: int = 0, reasoning: int = 0) -> dict[str, Any]:
    return {"input_tokens": prompt, "input_tokens_details": {"cached_tokens": cached},
            "output_tokens": completion, "output_tokens_details": {"reasoning_tokens": reasoning},
            "total_tokens": prompt + completion}


def output_logprobs(entries: list[dict[str, Any]] | None) -> list[dict[str, Any]]:
    """Engine token entries -> the `output_text.logprobs` shape (token, logprob, bytes, top_logprobs)."""
    out = []
    for e in entries or ():
        top = [{"token": t["token"], "logprob": t["logprob"], "bytes": t.get("bytes") or list(t["token"].encode())}
               for t in e.get("top_logprobs") or ()]
        out.append({"token": e["token"], "logprob": e["logprob"],
                    "bytes": e.get("bytes") or list(e["token"].encode()), "top_logprobs": top})
    return out


def error_object(error: GatewayError) -> dict[str, Any]:
    return {"code": error.code, "message": error.message, "param": error.param, "type": error.type}


class ResponseShape:
    """The parts of a Response that do not come from the model: ids, timestamps, echoed parameters."""

    def __init__(self, request: ResponsesRequest, request_id: str, created_at: int, model: str,
                 previous_response_id: str | None, stored: bool, sampling_defaults: tuple[float | None, ...] = ()
                 ) -> None:
        """`sampling_defaults`: the profile's (temperature, top_p), what the engine uses when the request sets none:
        a Response echoes the values it was sampled with."""
        self.request = request
        self.default_temperature, self.default_top_p = (*sampling_defaults, None, None)[:2]
        self.request_id = request_id
        self.id = f"resp_{request_id}"
        self.created_at = created_at
        self.model = model
        self.previous_response_id = previous_response_id
        self.stored = stored
        self._items = 0

    def item_id(self, prefix: str) -> str:
        """A fresh item id (`msg_`, `fc_`, `rs_`), stable for the item's whole life."""
        self._items += 1
        return f"{prefix}_{self.request_id}_{self._items}"

    def echo(self) -> dict[str, Any]:
        r = self.request
        fmt = r.text.format.echo() if r.text and r.text.format else {"type": "text"}
        reasoning = {"effort": r.reasoning.effort if r.reasoning else None,
                     "summary": r.reasoning.summary if r.reasoning else None}
        return {
            "instructions": r.instructions,
            "max_output_tokens": r.max_output_tokens,
            "metadata": r.metadata or {},
            "parallel_tool_calls": r.parallel_tool_calls if r.parallel_tool_calls is not None else True,
            "previous_response_id": self.previous_response_id,
            "prompt_cache_key": r.prompt_cache_key,
            "reasoning": reasoning,
            "safety_identifier": r.safety_identifier,
            "store": self.stored,
            "temperature": _first_set(r.temperature, self.default_temperature, 1.0),
            "text": {"format": fmt},
            "tool_choice": r.tool_choice if r.tool_choice is not None else "auto",
            "tools": [t.echo() for t in r.tools or ()],
            "top_logprobs": r.top_logprobs if r.top_logprobs is not None else 0,
            "top_p": _first_set(r.top_p, self.default_top_p, 1.0),
            "truncation": r.truncation or "disabled",
            "user": r.user,
            "background": False,
        }

    def response(self, status: str, output: list[dict[str, Any]], usage: dict[str, Any] | None = None,
                 incomplete: str | None = None, error: dict[str, Any] | None = None) -> dict[str, Any]:
        return {
            "id": self.id,
            "object": "response",
            "created_at": self.created_at,
            "status": status,
            "error": error,
            "incomplete_details": {"reason": incomplete} if incomplete else None,
            "model": self.model,
            "output": output,
            "usage": usage,
            **self.echo(),
        }

    # -- output items (complete) ------------------------------------------------------------------

    def message_item(self, item_id: str, text: str, logprobs: list[dict[str, Any]] | None,
                     status: str) -> dict[str, Any]:
        part = {"type": "output_text", "text": text, "annotations": [], "logprobs": output_logprobs(logprobs)}
        return {"id": item_id, "type": "message", "role": "assistant", "status": status, "content": [part]}

    @staticmethod
    def call_item(item_id: str, call: dict[str, Any], status: str) -> dict[str, Any]:
        fn = call["function"]
        return {"id": item_id, "type": "function_call", "status": status, "call_id": call["id"],
                "name": fn["name"], "arguments": fn["arguments"]}

    @staticmethod
    def reasoning_item(item_id: str, text: str, status: str) -> dict[str, Any]:
        return {"id": item_id, "type": "reasoning", "status": status, "summary": [],
                "content": [{"type": "reasoning_text", "text": text}]}


def _first_set(*values: float | None) -> float | None:
    return next((v for v in values if v is not None), None)


FAILED_FINISH = ("cancelled", "error")  # a choice that closed without an answer


def terminal_status(finish_reason: str | None) -> tuple[str, str | None]:
    """(status, incomplete reason) for the choice's finish reason."""
    if finish_reason in FAILED_FINISH:
        return "failed", None
    if finish_reason == "length":
        return "incomplete", "max_output_tokens"
    return "completed", None


def render_response(shape: ResponseShape, result: GenerationResult) -> dict[str, Any]:
    """The blocking Response: reasoning item, then the message or the function calls."""
    choice = result.choices[0]
    status, incomplete = terminal_status(choice["finish_reason"])
    if status == "failed":  # as on the native route: no answer is an error status, not a response object
        code = "cancelled" if choice["finish_reason"] == "cancelled" else "inference_error"
        raise worker_error(code, "the model did not complete the request")
    item_status = "incomplete" if incomplete else "completed"
    output: list[dict[str, Any]] = []
    if choice.get("reasoning"):
        output.append(shape.reasoning_item(shape.item_id("rs"), choice["reasoning"], item_status))
    if choice["tool_calls"]:
        output.extend(shape.call_item(shape.item_id("fc"), call, item_status) for call in choice["tool_calls"])
    elif not shape.request.forces_tool_call:  # a forced call cut off before it closed: no call and no message
        output.append(shape.message_item(shape.item_id("msg"), choice["text"], choice["logprobs"], item_status))
    usage = responses_usage(result.prompt_tokens, result.completion_tokens, result.cached_tokens)
    return shape.response(status, output, usage, incomplete)


def output_messages(response: dict[str, Any]) -> list[dict[str, Any]]:
    """A finished Response's output as wire messages, for replay through `previous_response_id`."""
    text: list[str] = []
    reasoning: list[str] = []
    calls: list[dict[str, Any]] = []
    for item in response["output"]:
        if item["type"] == "message":
            text.extend(part["text"] for part in item["content"])
        elif item["type"] == "reasoning":
            reasoning.extend(part["text"] for part in item.get("content") or ())
        elif item["type"] == "function_call":
            calls.append({"id": item["call_id"], "type": "function",
                          "function": {"name": item["name"], "arguments": item["arguments"]}})
    message: dict[str, Any] = {"role": "assistant", "content": "".join(text) if not calls else None}
    if calls:
        message["tool_calls"] = calls
    if reasoning:
        message["reasoning_content"] = "".join(reasoning)
    return [message]
