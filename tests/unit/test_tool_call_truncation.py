"""A candidate cut off by the token limit keeps the tool calls it completed (docs/contract.md, "Chat completions:
responses").

The audit's case: SmolLM2, `max_tokens: 32`, `tool_choice: "required"`, "Weather in Paris?" produced one
complete call and the start of a second, and came back as raw JSON content with `finish_reason: "length"`.
"""

from __future__ import annotations

import json
from types import SimpleNamespace
from typing import Any

import pytest

from engine.core.postprocess import OutputPostprocessor
from engine.text.tool_parser import parse_tool_calls
from gateway.contracts.responses import ResponsesRequest
from gateway.domain import GenerationEvent, GenerationRequest, GenerationResult
from gateway.render.chat import ChatStreamRenderer, render_chat_completion
from gateway.render.responses import ResponseShape, render_response
from gateway.render.responses_stream import ResponsesStreamRenderer

NAMES = {"get_weather", "get_time"}
TOOLS = ({"type": "function", "function": {"name": "get_weather", "description": "Get weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}},
    {"type": "function", "function": {"name": "get_time", "parameters": {"type": "object"}}})
CUT = ('[{"name": "get_weather", "arguments": {"city": "Paris"}}, '
       '{"name": "get_weather", "arguments": {"city')  # the audit's output, verbatim


def _names_args(calls: list[dict[str, Any]]) -> list[tuple[str, Any]]:
    return [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in calls]


@pytest.mark.parametrize("text, expected", [
    (CUT, [("get_weather", {"city": "Paris"})]),
    ('[{"name": "get_time", "arguments": {}}', [("get_time", {})]),  # cut before the closing bracket
    ('[{"name": "get_time", "arguments": {}},', [("get_time", {})]),
    ('  [{"name": "get_time", "arguments": {}}, {"name": "get_weather", "arguments": {"city": "Oslo"}},\n {"na',
     [("get_time", {}), ("get_weather", {"city": "Oslo"})]),
    ('<tool_call>{"name": "get_time", "arguments": {}}</tool_call>\n<tool_call>{"name": "get_w',
     [("get_time", {})]),
])
def test_a_truncated_call_array_keeps_its_complete_calls(text, expected):
    assert _names_args(parse_tool_calls(text, NAMES, truncated=True)) == expected


@pytest.mark.parametrize("text", [
    "Paris is sunny and",  # plain text stays plain text
    '[{"name": "get_weather", "arguments": {"city',  # no call was completed
    '{"name": "get_time", "arguments": {',
    "[1, 2, 3",  # an array, but not of calls
    '[{"name": "get_time", "arguments": {}}, 7',
    '[{"name": "get_time", "arguments": {}} {"name": "get_time"',  # not an array cut short
    '[{"name": "undeclared", "arguments": {}}, {"na',
    "[",
])
def test_truncated_text_without_a_complete_declared_call_is_content(text):
    assert parse_tool_calls(text, NAMES, truncated=True) == []


def test_an_unterminated_array_that_was_not_cut_off_is_content():
    assert parse_tool_calls(CUT, NAMES) == []


def _seq(text: str, finish_reason: str, parallel: bool | None = None) -> Any:
    params = SimpleNamespace(grammar=None, tools=list(TOOLS), tool_choice="required", parallel_tool_calls=parallel)
    return SimpleNamespace(params=params, grammar=None, full_text=text, finish_reason=finish_reason)


def test_the_closing_fields_of_a_length_cut_candidate_report_its_calls_and_keep_length():
    """The finish stays `length` (each surface says it its way); a call that closed normally is `tool_calls`."""
    fields = OutputPostprocessor(None).for_sequence(_seq(CUT, "length"))
    assert "finish_reason" not in fields  # the candidate's own `length` stands
    assert _names_args(fields["tool_calls"]) == [("get_weather", {"city": "Paris"})]
    assert OutputPostprocessor(None).for_sequence(_seq("Paris is sunny and", "length")) == {}
    whole = '[{"name": "get_weather", "arguments": {"city": "Paris"}}]'
    assert OutputPostprocessor(None).for_sequence(_seq(whole, "stop"))["finish_reason"] == "tool_calls"


def _closing() -> dict[str, Any]:
    return {"finish_reason": "length", **OutputPostprocessor(None).for_sequence(_seq(CUT, "length"))}


def _request(stream: bool) -> GenerationRequest:
    return GenerationRequest(model="m", max_tokens=32, max_tokens_param="max_tokens", messages=(),
                             stream=stream, tools=TOOLS, tool_choice="required")


def test_blocking_and_streamed_chat_agree_on_a_truncated_call_at_every_split():
    fields = _closing()
    result = GenerationResult({0: {"text": CUT, "finish_reason": fields["finish_reason"], "logprobs": [],
                                   "tool_calls": fields["tool_calls"], "completion_tokens": 32, "reasoning": None}},
                              9, 32, None, None)
    blocking = render_chat_completion(_request(False), result, "rid", 1, "m", False)["choices"][0]
    assert blocking["message"]["content"] is None and blocking["finish_reason"] == "tool_calls"
    expected = [(c["id"], c["function"]["name"], c["function"]["arguments"]) for c in blocking["message"]["tool_calls"]]
    assert [name for _, name, _ in expected] == ["get_weather"]
    for split in range(len(CUT) + 1):
        renderer = ChatStreamRenderer(_request(True), "rid", 1, "m", reasoning=False)
        chunks = renderer.on_event(GenerationEvent(index=0, text=CUT[:split], prompt_tokens=9))
        chunks += renderer.on_event(GenerationEvent(index=0, text=CUT[split:], prompt_tokens=9, completion_tokens=32,
                                                    **fields))
        choices = [c["choices"][0] for c in chunks]
        assert "".join(ch["delta"].get("content") or "" for ch in choices) == ""  # the raw JSON never leaks
        deltas = [d for ch in choices for d in ch["delta"].get("tool_calls", [])]
        assert [(d["id"], d["function"]["name"], d["function"]["arguments"]) for d in deltas] == expected
        assert [ch["finish_reason"] for ch in choices if ch["finish_reason"]] == ["tool_calls"]


def test_blocking_and_streamed_responses_carry_the_salvaged_call():
    fields = _closing()
    request = ResponsesRequest.model_validate({
        "model": "m", "input": "Weather in Paris?", "max_output_tokens": 32, "tool_choice": "required",
        "tools": [{"type": "function", "name": "get_weather", "parameters": TOOLS[0]["function"]["parameters"]}]})
    result = GenerationResult({0: {"text": CUT, "finish_reason": fields["finish_reason"], "logprobs": [],
                                   "tool_calls": fields["tool_calls"], "completion_tokens": 32, "reasoning": None}},
                              9, 32, None, None)
    blocking = render_response(ResponseShape(request, "rid", 1, "m", None, False), result)
    calls = [(o["type"], o["name"], o["arguments"]) for o in blocking["output"]]
    assert calls == [("function_call", "get_weather", fields["tool_calls"][0]["function"]["arguments"])]
    for split in range(len(CUT) + 1):
        renderer = ResponsesStreamRenderer(ResponseShape(request, "rid", 1, "m", None, False), True, False)
        events = renderer.on_event(GenerationEvent(index=0, text=CUT[:split], prompt_tokens=9))
        events += renderer.on_event(GenerationEvent(index=0, text=CUT[split:], prompt_tokens=9, completion_tokens=32,
                                                    **fields))
        assert not [e for e in events if e["type"] == "response.output_text.delta"]  # no raw JSON as text
        assert renderer.final_response is not None
        assert [(o["type"], o["name"], o["arguments"]) for o in renderer.final_response["output"]] == calls
        assert renderer.final_response["status"] == blocking["status"]
    # cut off by max_output_tokens: OpenAI's `incomplete`, though the complete call is kept
    assert (blocking["status"], blocking["incomplete_details"]) == ("incomplete", {"reason": "max_output_tokens"})
    assert [o["status"] for o in blocking["output"]] == ["incomplete"]


# -- a forced call cut off before any call closed: no call, and its syntax is no answer ---------------------------

BEFORE_ANY = '[{"name": "get'  # tool_choice "required", max_tokens 6 (the audit's case)


@pytest.mark.parametrize("tool_choice", ["required", {"type": "function", "function": {"name": "get_weather"}}])
def test_chat_never_returns_the_syntax_of_a_forced_call_as_content(tool_choice):
    request = GenerationRequest(model="m", max_tokens=6, max_tokens_param="max_tokens", messages=(), stream=False,
                                tools=TOOLS, tool_choice=tool_choice)
    result = GenerationResult({0: {"text": BEFORE_ANY, "finish_reason": "length", "logprobs": [], "tool_calls": None,
                                   "completion_tokens": 6, "reasoning": None}}, 9, 6, None, None)
    choice = render_chat_completion(request, result, "rid", 1, "m", False)["choices"][0]
    assert choice["message"]["content"] is None and "tool_calls" not in choice["message"]
    assert choice["finish_reason"] == "length"
    streamed = GenerationRequest(**{**request.__dict__, "stream": True})
    for split in range(len(BEFORE_ANY) + 1):
        renderer = ChatStreamRenderer(streamed, "rid", 1, "m", reasoning=False)
        chunks = renderer.on_event(GenerationEvent(index=0, text=BEFORE_ANY[:split], prompt_tokens=9))
        chunks += renderer.on_event(GenerationEvent(index=0, text=BEFORE_ANY[split:], prompt_tokens=9,
                                                    completion_tokens=6, finish_reason="length"))
        choices = [c["choices"][0] for c in chunks]
        assert not [ch for ch in choices if ch["delta"].get("content") or ch["delta"].get("tool_calls")]
        assert [ch["finish_reason"] for ch in choices if ch["finish_reason"]] == ["length"]


def test_an_unforced_cut_call_stays_content():
    """With tool_choice auto the model chose to write it: what it wrote is still returned (marked by `length`)."""
    request = GenerationRequest(model="m", max_tokens=6, max_tokens_param="max_tokens", messages=(), stream=False,
                                tools=TOOLS, tool_choice="auto")
    result = GenerationResult({0: {"text": BEFORE_ANY, "finish_reason": "length", "logprobs": [], "tool_calls": None,
                                   "completion_tokens": 6, "reasoning": None}}, 9, 6, None, None)
    assert render_chat_completion(request, result, "rid", 1, "m", False)["choices"][0]["message"]["content"] == \
        BEFORE_ANY


def test_a_response_never_carries_the_syntax_of_a_forced_call_as_a_message():
    request = ResponsesRequest.model_validate({
        "model": "m", "input": "Weather in Paris?", "max_output_tokens": 6, "tool_choice": "required",
        "tools": [{"type": "function", "name": "get_weather", "parameters": TOOLS[0]["function"]["parameters"]}]})
    result = GenerationResult({0: {"text": BEFORE_ANY, "finish_reason": "length", "logprobs": [], "tool_calls": None,
                                   "completion_tokens": 6, "reasoning": None}}, 9, 6, None, None)
    blocking = render_response(ResponseShape(request, "rid", 1, "m", None, False), result)
    assert (blocking["status"], blocking["output"]) == ("incomplete", [])
    for split in range(len(BEFORE_ANY) + 1):
        renderer = ResponsesStreamRenderer(ResponseShape(request, "rid", 1, "m", None, False), True, False)
        events = renderer.on_event(GenerationEvent(index=0, text=BEFORE_ANY[:split], prompt_tokens=9))
        events += renderer.on_event(GenerationEvent(index=0, text=BEFORE_ANY[split:], prompt_tokens=9,
                                                    completion_tokens=6, finish_reason="length"))
        assert not [e for e in events if e["type"].startswith("response.output_")]
        assert events[-1]["type"] == "response.incomplete" and renderer.final_response is not None
        assert renderer.final_response["output"] == []
