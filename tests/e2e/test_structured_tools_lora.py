"""Structured output, tool calling and LoRA through the openai SDK and the native route, real stack."""

from __future__ import annotations

import json
import re

import httpx
import jsonschema
import openai
import pytest

from tests.e2e.conftest import MODEL, SIE_MODEL

CITY_SCHEMA = {
    "type": "object",
    "properties": {"city": {"type": "string"}, "population": {"type": "integer"}},
    "required": ["city", "population"],
    "additionalProperties": False,
}
WEATHER_TOOL = {"type": "function", "function": {
    "name": "get_weather", "description": "Current weather for a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}
TIME_TOOL = {"type": "function", "function": {
    "name": "get_time", "parameters": {"type": "object", "properties": {"zone": {"type": "string"}},
                                       "required": ["zone"]}}}
ASK = [{"role": "user", "content": "Name a large city and its population as JSON."}]
WEATHER = [{"role": "user", "content": "What is the weather in Paris?"}]


def test_json_schema_n3_all_validate(openai_client):
    reply = openai_client.chat.completions.create(
        model=MODEL, messages=ASK, max_tokens=60, n=3, temperature=0.9, seed=7,
        response_format={"type": "json_schema", "json_schema": {"name": "city", "schema": CITY_SCHEMA}})
    assert len(reply.choices) == 3
    for choice in reply.choices:
        jsonschema.validate(json.loads(choice.message.content), CITY_SCHEMA)
        assert choice.finish_reason == "stop"


def test_json_object_is_an_object(openai_client):
    reply = openai_client.chat.completions.create(
        model=MODEL, messages=ASK, max_tokens=60, response_format={"type": "json_object"})
    assert isinstance(json.loads(reply.choices[0].message.content), dict)


def test_named_tool_choice_always_calls_that_function(openai_client):
    reply = openai_client.chat.completions.create(
        model=MODEL, messages=WEATHER, max_tokens=60, tools=[WEATHER_TOOL, TIME_TOOL],
        tool_choice={"type": "function", "function": {"name": "get_time"}})
    choice = reply.choices[0]
    assert choice.finish_reason == "tool_calls"
    assert choice.message.content is None
    calls = choice.message.tool_calls
    assert len(calls) == 1 and calls[0].type == "function" and calls[0].function.name == "get_time"
    assert "zone" in json.loads(calls[0].function.arguments)
    assert calls[0].id


def test_required_tool_choice_gives_a_parseable_call(openai_client):
    reply = openai_client.chat.completions.create(
        model=MODEL, messages=WEATHER, max_tokens=60, tools=[WEATHER_TOOL], tool_choice="required",
        parallel_tool_calls=False)
    calls = reply.choices[0].message.tool_calls
    assert [c.function.name for c in calls] == ["get_weather"]
    assert isinstance(json.loads(calls[0].function.arguments), dict)


def test_streamed_tool_call_deltas_join_to_the_blocking_result(openai_client):
    kwargs = dict(model=MODEL, messages=WEATHER, max_tokens=60, tools=[WEATHER_TOOL], tool_choice="required", seed=1)
    blocking = openai_client.chat.completions.create(**kwargs).choices[0].message.tool_calls
    names: dict[int, str] = {}
    args: dict[int, str] = {}
    finishes = []
    for chunk in openai_client.chat.completions.create(stream=True, **kwargs):
        for choice in chunk.choices:
            for call in choice.delta.tool_calls or []:
                if call.function.name:
                    names[call.index] = call.function.name
                args[call.index] = args.get(call.index, "") + (call.function.arguments or "")
            if choice.finish_reason:
                finishes.append(choice.finish_reason)
    assert finishes == ["tool_calls"]
    assert [names[i] for i in sorted(names)] == [c.function.name for c in blocking]
    assert [json.loads(args[i]) for i in sorted(args)] == [json.loads(c.function.arguments) for c in blocking]


def test_response_format_with_forcing_tool_choice_is_rejected(openai_client):
    with pytest.raises(openai.BadRequestError) as info:
        openai_client.chat.completions.create(
            model=MODEL, messages=WEATHER, tools=[WEATHER_TOOL], tool_choice="required",
            response_format={"type": "json_object"})
    assert info.value.param == "tool_choice"


def test_lora_adapter_changes_output_and_unknown_is_rejected(openai_client):
    question = [{"role": "user", "content": "What is the capital of France?"}]
    base = openai_client.chat.completions.create(model=MODEL, messages=question, max_tokens=16, temperature=0)
    pirate = openai_client.chat.completions.create(model=MODEL, messages=question, max_tokens=16, temperature=0,
                                                   extra_body={"lora_adapter": "pirate"})
    # the adapter is trained at setup (a few steps on CPU, not bit-reproducible): it must change the output
    assert base.choices[0].message.content != pirate.choices[0].message.content
    with pytest.raises(openai.BadRequestError) as info:
        openai_client.chat.completions.create(model=MODEL, messages=question, max_tokens=4,
                                              extra_body={"lora_adapter": "nope"})
    assert info.value.code == "unknown_lora_adapter" and info.value.param == "lora_adapter"


def test_native_regex_grammar(stack):
    r = httpx.post(f"{stack.base_url}/v1/generate/{SIE_MODEL}", timeout=60, json={
        "prompt": "My phone number is", "max_new_tokens": 20, "grammar": {"regex": r"\d{3}-\d{4}"}})
    assert r.status_code == 200, r.text
    assert re.fullmatch(r"\d{3}-\d{4}", r.json()["text"])


def test_native_invalid_grammar_is_a_400(stack):
    r = httpx.post(f"{stack.base_url}/v1/generate/{SIE_MODEL}", timeout=60, json={
        "prompt": "x", "max_new_tokens": 5, "grammar": {"regex": "(unclosed"}})
    assert r.status_code == 400
    assert r.json()["error"]["param"] == "grammar"
