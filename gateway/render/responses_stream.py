"""Model events -> Responses API stream events, in OpenAI's grammar.

    response.created, response.in_progress,
    per item: output_item.added, [content_part.added, *.delta..., *.done, content_part.done], output_item.done
    exactly one terminal: response.completed | response.incomplete | response.failed

Every event carries a monotonic `sequence_number`. Ids come from the request's `ResponseShape`, so the items
in the terminal event's response are the very ones streamed. The engine reports a tool call complete on the
choice's closing event, so with tools offered, leading text that may still become a call is held back
(`ToolHoldback`, as on chat) and a call is streamed as one arguments delta, always followed by its `.done`.
"""

from __future__ import annotations

from typing import Any

from gateway.domain import GenerationEvent
from gateway.errors import GatewayError, MalformedWorkerResponse, tokens_used, worker_error
from gateway.render.responses import ResponseShape, error_object, responses_usage, terminal_status
from gateway.render.tool_holdback import ToolHoldback


def _delta_logprobs(entries: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [{"token": e["token"], "logprob": e["logprob"],
             "top_logprobs": [{"token": t["token"], "logprob": t["logprob"]} for t in e.get("top_logprobs") or ()]}
            for e in entries]


class _OpenPart:
    """An item with one content part being streamed (a message's output_text, or reasoning_text)."""

    def __init__(self, item_id: str, output_index: int) -> None:
        self.item_id = item_id
        self.output_index = output_index
        self.text: list[str] = []
        self.logprobs: list[dict[str, Any]] = []


class ResponsesStreamRenderer:
    def __init__(self, shape: ResponseShape, tools_active: bool, logprobs: bool) -> None:
        self.shape = shape
        self.logprobs = logprobs
        self.holdback = ToolHoldback() if tools_active else None
        self.seq = 0
        self.started = False
        self.output: list[dict[str, Any]] = []  # finished items, in output order
        self.message: _OpenPart | None = None
        self.reasoning: _OpenPart | None = None
        self.pending_logprobs: list[dict[str, Any]] = []  # of text still held back
        self.prompt_tokens = self.cached_tokens = self.completion_tokens = 0
        self.final_response: dict[str, Any] | None = None  # set with the terminal event

    # -- the StreamRenderer protocol ---------------------------------------------------------------

    def on_event(self, event: GenerationEvent) -> list[dict[str, Any]]:
        out: list[dict[str, Any]] = []
        if not self.started:
            self.started = True
            snapshot = self.shape.response("in_progress", [])
            out += [self._event("response.created", response=snapshot),
                    self._event("response.in_progress", response=snapshot)]
        if self.final_response is not None:
            return out  # nothing follows the terminal event
        self.prompt_tokens = max(self.prompt_tokens, event.prompt_tokens)
        self.cached_tokens = max(self.cached_tokens, event.cached_tokens)
        if event.reasoning:
            out += self._reasoning_delta(event.reasoning)
        if event.logprobs and self.logprobs:
            self.pending_logprobs.extend(event.logprobs)
        text = self.holdback.feed(0, event.text) if self.holdback is not None else event.text
        if text:
            out += self._text_delta(text)
        self.completion_tokens = max(self.completion_tokens, event.completion_tokens)  # deltas count so far too
        if event.finish_reason is not None:
            out += self._close(event)
        return out

    def usage_chunk(self) -> dict[str, Any] | None:
        """At the end of the model stream: the terminal event is already out, unless the stream broke off."""
        if self.final_response is not None:
            return None
        return self.error_chunk(MalformedWorkerResponse("the model ended without closing the response"))

    def error_chunk(self, error: GatewayError) -> dict[str, Any]:
        output = list(self.output)
        for part, kind in ((self.reasoning, "reasoning"), (self.message, "message")):
            if part is not None:
                output.append(self._item(kind, part, "incomplete"))
        prompt, completion = tokens_used(error, (self.prompt_tokens, self.completion_tokens))
        usage = responses_usage(prompt, completion, self.cached_tokens)
        self.final_response = self.shape.response("failed", output, usage, error=error_object(error))
        return self._event("response.failed", response=self.final_response)

    # -- items --------------------------------------------------------------------------------------

    def _event(self, kind: str, **fields: Any) -> dict[str, Any]:
        event = {"type": kind, "sequence_number": self.seq, **fields}
        self.seq += 1
        return event

    def _item(self, kind: str, part: _OpenPart, status: str) -> dict[str, Any]:
        text = "".join(part.text)
        if kind == "reasoning":
            return self.shape.reasoning_item(part.item_id, text, status)
        return self.shape.message_item(part.item_id, text, part.logprobs if self.logprobs else None, status)

    def _open(self, kind: str, prefix: str) -> tuple[_OpenPart, list[dict[str, Any]]]:
        part = _OpenPart(self.shape.item_id(prefix), len(self.output))
        item = self._item(kind, part, "in_progress")
        content_part = item["content"][0]
        item["content"] = []  # the part arrives with its own event
        events = [
            self._event("response.output_item.added", output_index=part.output_index, item=item),
            self._event("response.content_part.added", item_id=part.item_id, output_index=part.output_index,
                        content_index=0, part=content_part),
        ]
        return part, events

    def _finish(self, kind: str, part: _OpenPart, status: str) -> list[dict[str, Any]]:
        item = self._item(kind, part, status)
        content_part = item["content"][0]
        where = {"item_id": part.item_id, "output_index": part.output_index, "content_index": 0}
        if kind == "message":
            done = self._event("response.output_text.done", **where, text=content_part["text"],
                               logprobs=_delta_logprobs(part.logprobs))
        else:
            done = self._event("response.reasoning_text.done", **where, text=content_part["text"])
        self.output.append(item)
        return [done, self._event("response.content_part.done", **where, part=content_part),
                self._event("response.output_item.done", output_index=part.output_index, item=item)]

    def _reasoning_delta(self, text: str) -> list[dict[str, Any]]:
        events: list[dict[str, Any]] = []
        if self.reasoning is None:
            if self.message is not None:  # reasoning after the answer began: keep it with the answer
                return self._text_delta(text)
            self.reasoning, events = self._open("reasoning", "rs")
        self.reasoning.text.append(text)
        events.append(self._event("response.reasoning_text.delta", item_id=self.reasoning.item_id,
                                  output_index=self.reasoning.output_index, content_index=0, delta=text))
        return events

    def _close_reasoning(self, status: str = "completed") -> list[dict[str, Any]]:
        if self.reasoning is None:
            return []
        events = self._finish("reasoning", self.reasoning, status)
        self.reasoning = None
        return events

    def _text_delta(self, text: str) -> list[dict[str, Any]]:
        events = self._close_reasoning()
        if self.message is None:
            self.message, opened = self._open("message", "msg")
            events += opened
        logprobs, self.pending_logprobs = self.pending_logprobs, []
        self.message.text.append(text)
        self.message.logprobs.extend(logprobs)
        events.append(self._event("response.output_text.delta", item_id=self.message.item_id,
                                  output_index=self.message.output_index, content_index=0, delta=text,
                                  logprobs=_delta_logprobs(logprobs)))
        return events

    def _close(self, event: GenerationEvent) -> list[dict[str, Any]]:
        status, incomplete = terminal_status(event.finish_reason)
        if status == "failed":
            code = "cancelled" if event.finish_reason == "cancelled" else "inference_error"
            return [self.error_chunk(worker_error(code, "the model did not complete the request"))]
        item_status = "incomplete" if incomplete else "completed"
        held = self.holdback.close(0) if self.holdback is not None else ""
        events = self._close_reasoning(item_status)
        if event.tool_calls and self.message is None:
            for call in event.tool_calls:
                events += self._stream_call(call, item_status)
        elif self.shape.request.forces_tool_call and self.message is None:
            pass  # a forced call cut off before it closed: no call, and its syntax is no message either
        else:
            if held or self.message is None:
                events += self._text_delta(held)
            assert self.message is not None
            events += self._finish("message", self.message, item_status)
            self.message = None
        usage = responses_usage(self.prompt_tokens, self.completion_tokens, self.cached_tokens)
        self.final_response = self.shape.response(status, list(self.output), usage, incomplete)
        events.append(self._event(f"response.{status}", response=self.final_response))
        return events

    def _stream_call(self, call: dict[str, Any], status: str) -> list[dict[str, Any]]:
        item_id = self.shape.item_id("fc")
        index = len(self.output)
        done = self.shape.call_item(item_id, call, status)
        added = {**done, "status": "in_progress", "arguments": ""}
        where = {"item_id": item_id, "output_index": index}
        self.output.append(done)
        return [
            self._event("response.output_item.added", output_index=index, item=added),
            self._event("response.function_call_arguments.delta", **where, delta=done["arguments"]),
            self._event("response.function_call_arguments.done", **where, arguments=done["arguments"],
                        name=done["name"]),
            self._event("response.output_item.done", output_index=index, item=done),
        ]
