"""Gemma 3 270M, served by the transformers model path, through every contract on the real stack.

The model is the base Gemma 3 (no instruction tuning), so assertions are about the contract and about
exactness (streamed equals blocking, grammar obeyed), not about the quality of its answers.
"""

from __future__ import annotations

import json

import httpx
import pytest

from tests.helpers.sse import data_payloads

GEMMA = "google/gemma-3-270m"
GEMMA_SIE = "google__gemma-3-270m"
FRANCE = "The capital of France is"


def test_discovered_like_any_model(openai_client):
    assert GEMMA in {m.id for m in openai_client.models.list().data}


def test_completions_blocking_and_streamed_agree(openai_client):
    blocking = openai_client.completions.create(model=GEMMA, prompt=FRANCE, max_tokens=12, temperature=0)
    (choice,) = blocking.choices
    assert choice.text and 0 < blocking.usage.completion_tokens <= 12
    chunks = list(openai_client.completions.create(model=GEMMA, prompt=FRANCE, max_tokens=12, temperature=0,
                                                   stream=True, stream_options={"include_usage": True}))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == choice.text
    assert chunks[-1].usage == blocking.usage


def test_chat_uses_the_profiles_gemma_template(openai_client):
    messages = [{"role": "system", "content": "Answer in one word."},
                {"role": "user", "content": "What is the capital of France?"}]
    blocking = openai_client.chat.completions.create(model=GEMMA, messages=messages, max_tokens=16, temperature=0)
    text = blocking.choices[0].message.content
    assert blocking.choices[0].finish_reason in ("stop", "length")
    # `<bos><start_of_turn>user\n{system}\n\n{user}<end_of_turn>\n<start_of_turn>model\n`: far more tokens than
    # the two messages alone, so a missing template (raw concatenation) would show here
    assert blocking.usage.prompt_tokens > 20
    streamed = openai_client.chat.completions.create(model=GEMMA, messages=messages, max_tokens=16, temperature=0,
                                                     stream=True)
    assert "".join(c.choices[0].delta.content or "" for c in streamed if c.choices) == text
    assert "<end_of_turn>" not in text  # the turn end is a stop token from the profile, never shown


def test_native_generate_blocking_and_streamed(stack):
    url = f"{stack.base_url}/v1/generate/{GEMMA_SIE}"
    body = {"prompt": FRANCE, "max_new_tokens": 8, "temperature": 0}
    r = httpx.post(url, json=body, timeout=120)
    assert r.status_code == 200, r.text
    blocking = r.json()
    assert blocking["model"] == GEMMA and blocking["usage"]["completion_tokens"] > 0
    with httpx.stream("POST", url, json={**body, "stream": True}, timeout=120) as s:
        assert s.status_code == 200
        payloads = list(data_payloads(s.iter_lines()))
    assert payloads[-1] == "[DONE]"
    events = [json.loads(p) for p in payloads[:-1]]
    assert "".join(e["text_delta"] for e in events) == blocking["text"]


@pytest.mark.parametrize("schema", [{"type": "object", "properties": {"city": {"type": "string", "maxLength": 12}},
                                     "required": ["city"], "additionalProperties": False}])
def test_json_schema_is_obeyed(openai_client, schema):
    reply = openai_client.chat.completions.create(
        model=GEMMA, messages=[{"role": "user", "content": "Which city is the capital of France?"}],
        max_tokens=40, temperature=0.7, seed=3,
        response_format={"type": "json_schema", "json_schema": {"name": "answer", "schema": schema, "strict": True}})
    assert reply.choices[0].finish_reason == "stop"
    answer = json.loads(reply.choices[0].message.content)
    assert set(answer) == {"city"} and len(answer["city"]) <= 12


CITY_TOOL = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 20}}, "required": ["city"],
                   "additionalProperties": False}}}


def test_a_forced_tool_call_is_a_parseable_call_blocking_and_streamed(openai_client):
    """Tools on the generic path: the forced call's grammar (xgrammar masks on Gemma's 262k vocabulary) makes
    a call to the named function with arguments that fit its schema, and streamed deltas join to the same."""
    kwargs = dict(model=GEMMA, messages=[{"role": "user", "content": "What is the weather in Paris?"}],
                  max_tokens=60, tools=[CITY_TOOL], tool_choice="required", parallel_tool_calls=False,
                  temperature=0)
    choice = openai_client.chat.completions.create(**kwargs).choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    (call,) = choice.message.tool_calls
    assert call.id and call.function.name == "get_weather"
    arguments = json.loads(call.function.arguments)
    assert set(arguments) == {"city"} and len(arguments["city"]) <= 20
    deltas = [d for c in openai_client.chat.completions.create(**kwargs, stream=True) if c.choices
              for d in c.choices[0].delta.tool_calls or []]
    assert deltas[0].function.name == "get_weather"
    assert json.loads("".join(d.function.arguments or "" for d in deltas)) == arguments
