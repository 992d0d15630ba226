"""/v1/responses through the official openai SDK against the real stack: blocking, every stream event,
`responses.parse` with a pydantic model, and a tool round trip (with the whole input, and on the store)."""

from __future__ import annotations

import json

import openai
import pytest
from pydantic import BaseModel

from tests.e2e.conftest import MODEL
from tests.responses_grammar import check_grammar

WEATHER_TOOL = {"type": "function", "name": "get_weather", "description": "Current weather for a city",
                "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"],
                               "additionalProperties": False}, "strict": True}
FRANCE = "Complete the sentence: The capital of France is"


class City(BaseModel):
    city: str
    population: int


def test_blocking_create(openai_client):
    reply = openai_client.responses.create(model=MODEL, input=FRANCE, instructions="Answer in one sentence.",
                                           max_output_tokens=40, temperature=0, metadata={"case": "blocking"})
    assert reply.object == "response" and reply.id.startswith("resp_") and reply.model == MODEL
    assert reply.status in ("completed", "incomplete")
    assert "Paris" in reply.output_text
    assert reply.output[0].type == "message" and reply.output[0].content[0].type == "output_text"
    assert reply.usage.input_tokens > 0 and 0 < reply.usage.output_tokens <= 40
    assert reply.usage.total_tokens == reply.usage.input_tokens + reply.usage.output_tokens
    assert reply.usage.input_tokens_details.cached_tokens >= 0
    assert reply.usage.output_tokens_details.reasoning_tokens == 0
    assert reply.metadata == {"case": "blocking"} and reply.instructions == "Answer in one sentence."


def test_stream_every_event_matches_the_final_object(openai_client):
    blocking = openai_client.responses.create(model=MODEL, input=FRANCE, max_output_tokens=30, temperature=0)
    events = list(openai_client.responses.create(model=MODEL, input=FRANCE, max_output_tokens=30, temperature=0,
                                                 stream=True))
    kinds = [e.type for e in events]
    assert {"response.created", "response.in_progress", "response.output_item.added", "response.content_part.added",
            "response.output_text.delta", "response.output_text.done", "response.content_part.done",
            "response.output_item.done"} <= set(kinds)
    final = check_grammar([e.model_dump(mode="json", exclude_unset=True) for e in events])
    assert final["output"][0]["content"][0]["text"] == blocking.output_text
    assert events[-1].response.usage.output_tokens == blocking.usage.output_tokens


def test_stream_truncated_is_incomplete(openai_client):
    events = list(openai_client.responses.create(model=MODEL, input="Count from one to one hundred.",
                                                 max_output_tokens=3, temperature=0, stream=True))
    assert events[-1].type == "response.incomplete"
    assert events[-1].response.incomplete_details.reason == "max_output_tokens"
    check_grammar([e.model_dump(mode="json", exclude_unset=True) for e in events])


def test_parse_with_pydantic_text_format(openai_client):
    reply = openai_client.responses.parse(model=MODEL, input="Name a large city and its population as JSON.",
                                          text_format=City, max_output_tokens=60)
    assert isinstance(reply.output_parsed, City)
    assert reply.output_parsed.city


def _ask_weather(client, **kwargs):
    return client.responses.create(model=MODEL, tools=[WEATHER_TOOL], max_output_tokens=60, temperature=0,
                                   **kwargs)


def test_tool_round_trip_with_the_whole_input(openai_client):
    question = [{"role": "user", "content": "What is the weather in Paris?"}]
    first = _ask_weather(openai_client, input=question, tool_choice="required", parallel_tool_calls=False,
                         store=False)
    (call,) = [item for item in first.output if item.type == "function_call"]
    assert call.name == "get_weather" and call.call_id and "city" in json.loads(call.arguments)
    follow_up = [*question, *[item.model_dump(exclude_none=True) for item in first.output],
                 {"type": "function_call_output", "call_id": call.call_id, "output": "Sunny, 24 C"}]
    answer = _ask_weather(openai_client, input=follow_up, tool_choice="none", store=False)
    assert answer.status in ("completed", "incomplete") and answer.output[0].type == "message"
    assert answer.output_text.strip()


def test_tool_round_trip_on_the_store_streamed(openai_client):
    stream = openai_client.responses.create(model=MODEL, tools=[WEATHER_TOOL], max_output_tokens=60, stream=True,
                                            input="What is the weather in Paris?", tool_choice="required",
                                            parallel_tool_calls=False)
    typed = list(stream)
    first = typed[-1].response
    final = check_grammar([e.model_dump(mode="json", exclude_unset=True) for e in typed])
    (call,) = [item for item in first.output if item.type == "function_call"]
    assert final["output"][0]["call_id"] == call.call_id and final["output"][0]["id"] == call.id
    assert openai_client.responses.retrieve(first.id).output[0].call_id == call.call_id
    answer = _ask_weather(openai_client, previous_response_id=first.id, tool_choice="none",
                          input=[{"type": "function_call_output", "call_id": call.call_id, "output": "Sunny"}])
    assert answer.previous_response_id == first.id and answer.output_text.strip()


def test_errors_reach_the_sdk_typed(openai_client):
    with pytest.raises(openai.BadRequestError) as info:
        openai_client.responses.create(model=MODEL, input="hi", background=True)
    assert info.value.body["param"] == "background"
    with pytest.raises(openai.NotFoundError):
        openai_client.responses.create(model="no/such-model", input="hi")
    with pytest.raises(openai.NotFoundError):
        openai_client.responses.retrieve("resp_never")
