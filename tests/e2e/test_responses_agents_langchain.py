"""Agent frameworks on /v1/responses, unmodified, against the real stack: the OpenAI Agents SDK running an agent
with one function tool, and LangChain's ChatOpenAI(use_responses_api=True) invoke, stream and bind_tools."""

from __future__ import annotations

import asyncio

import pytest

from tests.e2e.conftest import MODEL

agents = pytest.importorskip("agents")
langchain_openai = pytest.importorskip("langchain_openai")

CALLS: list[str] = []


def get_weather(city: str) -> str:
    """Current weather for a city."""
    CALLS.append(city)
    return f"Sunny and 24 C in {city}"


def _agent(stack, **settings):
    from openai import AsyncOpenAI

    agents.set_tracing_disabled(True)  # no trace upload to api.openai.com
    client = AsyncOpenAI(base_url=stack.base_url + "/v1", api_key="unused", max_retries=0, timeout=120)
    model = agents.OpenAIResponsesModel(model=MODEL, openai_client=client)
    return agents.Agent(name="weather", instructions="Answer weather questions with the get_weather tool.",
                        tools=[agents.function_tool(get_weather)], model=model,
                        model_settings=agents.ModelSettings(max_tokens=100, temperature=0, parallel_tool_calls=False,
                                                            **settings),
                        tool_use_behavior="stop_on_first_tool")


def test_agents_sdk_runs_an_agent_with_one_function_tool(stack):
    CALLS.clear()
    agent = _agent(stack, tool_choice="get_weather")
    result = asyncio.run(agents.Runner.run(agent, "What is the weather in Paris?", max_turns=3))
    kinds = [item.type for item in result.new_items]
    assert "tool_call_item" in kinds and "tool_call_output_item" in kinds, kinds
    assert len(CALLS) == 1 and result.final_output == f"Sunny and 24 C in {CALLS[0]}"
    (raw,) = result.raw_responses
    assert raw.response_id and raw.response_id.startswith("resp_")


def test_agents_sdk_streamed_run(stack):
    CALLS.clear()

    async def run() -> list[str]:
        streamed = agents.Runner.run_streamed(_agent(stack, tool_choice="required"), "Weather in Rome?", max_turns=3)
        kinds = [event.type async for event in streamed.stream_events()]
        assert streamed.final_output.startswith("Sunny")
        return kinds

    kinds = asyncio.run(run())
    assert "raw_response_event" in kinds and "run_item_stream_event" in kinds and len(CALLS) == 1


def _chat(stack, max_tokens: int = 30):
    return langchain_openai.ChatOpenAI(model=MODEL, base_url=stack.base_url + "/v1", api_key="unused",
                                       use_responses_api=True, temperature=0, max_tokens=max_tokens, max_retries=0)


def test_langchain_invoke(stack):
    reply = _chat(stack).invoke("What is the capital of France?")
    assert "Paris" in reply.text
    assert reply.usage_metadata["input_tokens"] > 0 and reply.usage_metadata["output_tokens"] > 0
    assert reply.response_metadata["id"].startswith("resp_")


def test_langchain_stream(stack):
    chunks = list(_chat(stack).stream("What is the capital of France?"))
    text = "".join(chunk.text for chunk in chunks)
    assert len(chunks) > 2 and "Paris" in text


def test_langchain_bind_tools(stack):
    from langchain_core.tools import tool

    weather = tool(get_weather)
    bound = _chat(stack, max_tokens=60).bind_tools([weather], tool_choice="get_weather", parallel_tool_calls=False)
    reply = bound.invoke("What is the weather in Paris?")
    (call,) = reply.tool_calls
    assert call["name"] == "get_weather" and isinstance(call["args"].get("city"), str) and call["id"]
