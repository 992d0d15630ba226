"""Tool-call parsing (engine) and streamed tool-call deltas (gateway) at every split point."""

from __future__ import annotations

import json

import pytest

from engine.inputs.tool_grammar import forced_tool_grammar
from engine.text.tool_parser import parse_tool_calls
from gateway.domain import GenerationEvent, GenerationRequest, GenerationResult
from gateway.render.chat import ChatStreamRenderer, render_chat_completion

NAMES = {"get_weather", "get_time"}
CALL_TEXT = '[{"name": "get_weather", "arguments": {"city": "Paris"}}, {"name": "get_time", "arguments": {}}]'
TOOLS = ({"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}},
    {"type": "function", "function": {"name": "get_time", "parameters": {"type": "object"}}})


@pytest.mark.parametrize("text, expected", [
    (CALL_TEXT, [("get_weather", {"city": "Paris"}), ("get_time", {})]),
    ('{"name": "get_time", "arguments": {"zone": "UTC"}}', [("get_time", {"zone": "UTC"})]),
    ('{"name": "get_time", "arguments": {}}\nand then some rambling', [("get_time", {})]),
    ('<tool_call>{"name": "get_weather", "arguments": {"city": "Oslo"}}</tool_call>',
     [("get_weather", {"city": "Oslo"})]),
    ('{"name": "get_time", "parameters": {"zone": "CET"}}', [("get_time", {"zone": "CET"})]),
])
def test_parses_calls(text, expected):
    calls = parse_tool_calls(text, NAMES)
    assert [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in calls] == expected
    assert all(c["type"] == "function" and c["id"].startswith("call_") for c in calls)
    assert len({c["id"] for c in calls}) == len(calls)


@pytest.mark.parametrize("text", [
    "Paris is sunny.",
    '{"name": "undeclared", "arguments": {}}',
    '[{"name": "get_time", "arguments": {}}, {"name": "nope", "arguments": {}}]',
    '{"name": "get_time", "arguments": {',
    '{"city": "Paris"}',
    "",
    # a call after prose is prose: the stream has already sent that prose as content
    'Sure! <tool_call>{"name": "get_time", "arguments": {}}</tool_call>',
])
def test_text_that_is_not_a_declared_call_is_content(text):
    assert parse_tool_calls(text, NAMES) == []


def test_forced_grammars():
    named = forced_tool_grammar(list(TOOLS), {"type": "function", "function": {"name": "get_time"}}, None)
    assert named.value["maxItems"] == 1
    assert named.value["items"]["properties"]["name"] == {"const": "get_time"}
    required = forced_tool_grammar(list(TOOLS), "required", False)
    assert required.value["maxItems"] == 1 and len(required.value["items"]["anyOf"]) == 2
    assert "maxItems" not in forced_tool_grammar(list(TOOLS), "required", True).value
    assert forced_tool_grammar(list(TOOLS), "auto", None) is None


def _request(stream: bool) -> GenerationRequest:
    return GenerationRequest(model="m", max_tokens=64, max_tokens_param="max_tokens", messages=(),
                             stream=stream, tools=TOOLS, tool_choice="auto")


def _stream(text: str, split: int, calls, before_close: list[str] | None = None) -> tuple[list[dict], str]:
    renderer = ChatStreamRenderer(_request(True), "rid", 1, "m", reasoning=False)
    events = [GenerationEvent(index=0, text=text[:split], prompt_tokens=3),
              GenerationEvent(index=0, text=text[split:], finish_reason="stop", prompt_tokens=3,
                              completion_tokens=9, tool_calls=calls)]
    first = renderer.on_event(events[0])
    if before_close is not None:  # what the client had before the choice closed
        before_close.append("".join(c["choices"][0]["delta"].get("content") or "" for c in first))
    chunks = first + renderer.on_event(events[1])
    deltas = [d for c in chunks for d in c["choices"][0]["delta"].get("tool_calls", [])]
    content = "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks)
    finishes = [c["choices"][0]["finish_reason"] for c in chunks if c["choices"][0]["finish_reason"]]
    assert finishes == ["tool_calls" if calls else "stop"]
    return deltas, content


def _joined(deltas: list[dict]) -> list[tuple[str, str, str]]:
    calls: dict[int, list[str]] = {}
    for d in deltas:
        entry = calls.setdefault(d["index"], [d.get("id", ""), d["function"].get("name", ""), ""])
        entry[2] += d["function"].get("arguments", "")
    return [tuple(calls[i]) for i in sorted(calls)]


def test_streamed_tool_call_deltas_join_to_the_blocking_result_at_every_split():
    calls = parse_tool_calls(CALL_TEXT, NAMES)
    result = GenerationResult({0: {"text": CALL_TEXT, "finish_reason": "stop", "logprobs": [], "tool_calls": calls,
                                   "completion_tokens": 9, "reasoning": None}}, 3, 9, None, None)
    blocking = render_chat_completion(_request(False), result, "rid", 1, "m", False)["choices"][0]
    assert blocking["message"]["content"] is None and blocking["finish_reason"] == "tool_calls"
    expected = [(c["id"], c["function"]["name"], c["function"]["arguments"]) for c in blocking["message"]["tool_calls"]]
    for split in range(len(CALL_TEXT) + 1):
        deltas, content = _stream(CALL_TEXT, split, calls)
        assert content == ""  # held text never leaks as content when it was a call
        assert _joined(deltas) == expected


def test_plain_text_with_tools_streams_as_content_at_every_split():
    text = "It is sunny in Paris."
    for split in range(len(text) + 1):
        deltas, content = _stream(text, split, None)
        assert deltas == [] and content == text


@pytest.mark.parametrize("text", ["It is sunny in Paris.", "  \nParis.", "<b>Paris</b>", "<tool>x"])
def test_text_that_cannot_start_a_call_streams_before_the_choice_closes(text):
    for split in range(len(text) + 1):
        seen: list[str] = []
        deltas, content = _stream(text, split, None, seen)
        assert deltas == [] and content == text
        head = text[:split]
        if head.strip() and not "<tool_call>".startswith(head.strip()):
            assert seen == [head], (split, seen)  # streamed at once, not held to the end


@pytest.mark.parametrize("text", ['[{"name": "x"', "  {", "<tool_", "\n<tool_call>{", "  "])
def test_text_that_may_still_become_a_call_is_held(text):
    seen: list[str] = []
    _stream(text + " and more", len(text), None, seen)
    assert seen == [""]


def test_streamed_content_joins_to_the_blocking_content_with_tools_at_every_split():
    text = "Sure, here it is: [1, 2]"
    result = GenerationResult({0: {"text": text, "finish_reason": "stop", "logprobs": [], "tool_calls": None,
                                   "completion_tokens": 9, "reasoning": None}}, 3, 9, None, None)
    blocking = render_chat_completion(_request(False), result, "rid", 1, "m", False)["choices"][0]
    for split in range(len(text) + 1):
        deltas, content = _stream(text, split, None)
        assert deltas == [] and content == blocking["message"]["content"]
