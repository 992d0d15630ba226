"""/v1/responses through the real app against the fake Triton: request mapping, the Response object,
the stream grammar (text, tool calls, truncation, a failure mid-stream), errors, and the store."""

from __future__ import annotations

import asyncio

import pytest

from gateway.errors import WorkerError, worker_error
from tests.helpers.sse import parse_named_sse
from tests.integration.conftest import BASE_PARAMS, HANG, MODEL, TRITON_MODEL, assert_error, ev, raw_call, tokens
from tests.responses_grammar import check_grammar

CALL = {"id": "call_abc", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}
TOOL = {"type": "function", "name": "get_weather", "description": "weather",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}


async def post(gw, **body):
    return await gw.client.post("/v1/responses", json={"model": MODEL, "input": "hi", **body})


async def stream(gw, **body):
    resp = await post(gw, stream=True, **body)
    assert resp.status_code == 200, resp.text
    assert resp.headers["content-type"].startswith("text/event-stream")
    return parse_named_sse(resp.text)


async def test_blocking_text_response(gw):
    gw.fake().script = tokens("Hello", " world", prompt=7)
    resp = await post(gw, instructions="be brief", metadata={"k": "v"}, user="u-1", temperature=0.5)
    assert resp.status_code == 200, resp.text
    body = resp.json()
    assert body["object"] == "response" and body["id"].startswith("resp_") and body["status"] == "completed"
    (item,) = body["output"]
    assert item["type"] == "message" and item["role"] == "assistant" and item["status"] == "completed"
    assert item["content"] == [{"type": "output_text", "text": "Hello world", "annotations": [], "logprobs": []}]
    assert body["usage"] == {"input_tokens": 7, "input_tokens_details": {"cached_tokens": 0}, "output_tokens": 2,
                             "output_tokens_details": {"reasoning_tokens": 0}, "total_tokens": 9}
    assert body["metadata"] == {"k": "v"} and body["user"] == "u-1" and body["temperature"] == 0.5
    assert body["instructions"] == "be brief" and body["incomplete_details"] is None
    sent = gw.fake().calls[0].req
    assert sent.messages == ({"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"})
    assert sent.max_tokens_param == "max_output_tokens" and sent.temperature == 0.5


async def test_input_items_map_to_messages(gw):
    items = [
        {"role": "developer", "content": "dev rules"},
        {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "weather?"}]},
        {"type": "reasoning", "id": "rs_1", "summary": [], "content": [{"type": "reasoning_text", "text": "hmm"}]},
        {"type": "function_call", "call_id": "c1", "name": "get_weather", "arguments": '{"city":"Paris"}'},
        {"type": "function_call_output", "call_id": "c1", "output": "sunny"},
        {"role": "assistant", "content": [{"type": "output_text", "text": "It is sunny."}]},
    ]
    resp = await post(gw, input=items, tools=[TOOL])
    assert resp.status_code == 200, resp.text
    assert gw.fake().calls[0].req.messages == (
        {"role": "developer", "content": "dev rules"},  # kept as its own role
        {"role": "user", "content": "weather?"},
        {"role": "assistant", "content": None, "reasoning_content": "hmm", "tool_calls": [
            {"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city":"Paris"}'}}]},
        {"role": "tool", "tool_call_id": "c1", "content": "sunny"},
        {"role": "assistant", "content": "It is sunny."},
    )
    assert gw.fake().calls[0].req.tools == ({"type": "function", "function": {
        "name": "get_weather", "description": "weather", "parameters": TOOL["parameters"]}},)


async def test_blocking_tool_call(gw):
    gw.fake().script = [ev('{"name": "get_weather"', prompt=5),
                        ev(', "arguments": {"city": "Paris"}}', finish="tool_calls", prompt=5, completion=9,
                           tool_calls=[CALL])]
    body = (await post(gw, tools=[TOOL], tool_choice="required")).json()
    (item,) = body["output"]
    assert item == {"id": item["id"], "type": "function_call", "status": "completed", "call_id": "call_abc",
                    "name": "get_weather", "arguments": '{"city": "Paris"}'}
    assert body["status"] == "completed" and body["tool_choice"] == "required"
    assert gw.fake().calls[0].req.tool_choice == "required"


async def test_stream_text_grammar(gw):
    gw.fake().script = tokens("Hel", "lo", " there")
    events = await stream(gw)
    final = check_grammar(events)
    assert events[-1]["type"] == "response.completed" and final["status"] == "completed"
    assert final["output"][0]["content"][0]["text"] == "Hello there"
    assert final["usage"]["output_tokens"] == 3


async def test_stream_tool_call_grammar_ids_stable(gw):
    gw.fake().script = [ev('{"name": ', prompt=5),
                        ev('"get_weather", "arguments": {"city": "Paris"}}', finish="tool_calls", prompt=5,
                           completion=9, tool_calls=[CALL, {**CALL, "id": "call_def"}])]
    events = await stream(gw, tools=[TOOL])
    final = check_grammar(events)
    assert [i["call_id"] for i in final["output"]] == ["call_abc", "call_def"]
    assert not [e for e in events if e["type"] == "response.output_text.delta"]  # the call text was held back
    dones = [e for e in events if e["type"] == "response.function_call_arguments.done"]
    assert [d["arguments"] for d in dones] == ['{"city": "Paris"}'] * 2


async def test_stream_truncation_is_incomplete(gw):
    gw.fake().script = tokens("a", "b", finish="length")
    events = await stream(gw, max_output_tokens=2)
    final = check_grammar(events)
    assert events[-1]["type"] == "response.incomplete"
    assert final["status"] == "incomplete" and final["incomplete_details"] == {"reason": "max_output_tokens"}
    assert final["output"][0]["status"] == "incomplete" and final["max_output_tokens"] == 2


async def test_blocking_truncation_is_incomplete(gw):
    gw.fake().script = tokens("a", "b", finish="length")
    body = (await post(gw, max_output_tokens=2)).json()
    assert body["status"] == "incomplete" and body["incomplete_details"] == {"reason": "max_output_tokens"}


async def test_stream_failure_mid_stream_is_one_failed_event(gw):
    gw.fake().script = [ev("partial", prompt=4), ev(" more", prompt=4),
                        WorkerError("engine fell over", code="inference_error")]
    events = await stream(gw)
    final = check_grammar(events)
    assert events[-1]["type"] == "response.failed" and final["status"] == "failed"
    assert final["error"]["code"] == "inference_error" and final["error"]["message"] == "engine fell over"
    (item,) = final["output"]
    assert item["status"] == "incomplete" and item["content"][0]["text"] == "partial more"
    assert (final["usage"]["input_tokens"], final["usage"]["output_tokens"]) == (4, 0)  # no count was reported


async def test_a_failed_stream_reports_the_tokens_it_used(gw):
    """The model's count at the failure when it sent one, else the most its deltas reported."""
    gw.fake().script = [ev("partial", prompt=4, completion=1), ev(" more", prompt=4, completion=2),
                        worker_error("inference_error", "engine fell over", usage=(4, 3))]
    final = check_grammar(await stream(gw))
    assert final["status"] == "failed"
    assert (final["usage"]["input_tokens"], final["usage"]["output_tokens"], final["usage"]["total_tokens"]) == \
        (4, 3, 7)
    gw.fake().script = [ev("partial", prompt=4, completion=1), ev(" more", prompt=4, completion=2),
                        worker_error("inference_error", "engine fell over")]
    final = check_grammar(await stream(gw))
    assert (final["usage"]["input_tokens"], final["usage"]["output_tokens"]) == (4, 2)


async def test_stream_reasoning_item_before_message(gw):
    gw.fake().script = [ev("", reasoning="think ", prompt=3), ev("", reasoning="more", prompt=3),
                        ev("Answer", finish="stop", prompt=3, completion=5)]
    events = await stream(gw)
    final = check_grammar(events)
    assert [i["type"] for i in final["output"]] == ["reasoning", "message"]
    assert final["output"][0]["content"] == [{"type": "reasoning_text", "text": "think more"}]


async def test_logprobs_with_include(gw):
    entry = {"token": "Hi", "logprob": -0.1, "bytes": [72, 105], "top_logprobs": [
        {"token": "Hi", "logprob": -0.1, "bytes": [72, 105]}]}
    gw.fake().script = [ev("Hi", finish="stop", prompt=2, completion=1, logprobs=[entry])]
    body = (await post(gw, include=["message.output_text.logprobs"], top_logprobs=1)).json()
    assert body["output"][0]["content"][0]["logprobs"] == [entry]
    req = gw.fake().calls[0].req
    assert req.logprobs and req.top_logprobs == 1


async def test_text_format_json_schema_is_a_grammar(gw):
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
    await post(gw, text={"format": {"type": "json_schema", "name": "A", "schema": schema, "strict": True}})
    grammar = gw.fake().calls[0].req.grammar
    assert grammar.kind == "json_schema" and grammar.strict and grammar.label == "A"


@pytest.mark.parametrize(("body", "status", "code", "param"), [
    ({"input": ""}, 400, "invalid_request", "input"),
    ({"input": [{"type": "item_reference", "id": "x"}]}, 400, "unsupported_field", "input[0].type"),
    ({"input": [{"role": "robot", "content": "x"}]}, 400, "invalid_request", "input[0].role"),
    ({"input": [{"type": "function_call_output", "call_id": "nope", "output": "x"}]}, 400, "invalid_request",
     "input[0].call_id"),
    ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "https://x/y.png"}]}]}, 400,
     "invalid_request", "input[0].content[0].image_url"),
    ({"background": True}, 400, "unsupported_field", "background"),
    ({"tools": [{"type": "web_search"}]}, 400, "unsupported_field", "tools[0].type"),
    ({"tool_choice": {"type": "function", "name": "nope"}, "tools": [TOOL]}, 400, "invalid_request", "tool_choice"),
    ({"text": {"format": {"type": "json_schema", "name": "x"}}}, 400, "invalid_request", "text.format.schema"),
    ({"top_logprobs": 2}, 400, "invalid_request", "top_logprobs"),
    ({"include": ["file_search_call.results"]}, 400, "unsupported_field", "include[0]"),
    ({"service_tier": "auto"}, 400, "unsupported_field", "service_tier"),
    ({"frequency_penalty": 1}, 400, "unsupported_field", "frequency_penalty"),
    ({"max_output_tokens": 0}, 400, "invalid_request", "max_output_tokens"),
    ({"max_output_tokens": 999999}, 400, "context_exceeded", "max_output_tokens"),
    ({"reasoning": {"effort": "high"}}, 400, "unsupported_field", "reasoning.effort"),
    ({"model": "nope/nope"}, 404, "model_not_found", "model"),
])
async def test_errors_name_the_field(gw, body, status, code, param):
    assert_error(await post(gw, **body), status, code, param)
    assert not gw.fake().calls


async def test_without_a_store_stateful_fields_are_400(gw):
    assert gw.settings.responses_store is None
    assert_error(await post(gw, store=True), 400, "invalid_request", "store")
    assert_error(await post(gw, previous_response_id="resp_x"), 400, "invalid_request", "previous_response_id")
    assert_error(await gw.client.get("/v1/responses/resp_x"), 400, "invalid_request", "response_id")
    body = (await post(gw)).json()  # asks for nothing stateful: works, and says it was not stored
    assert body["store"] is False


@pytest.fixture
async def stored_gw(make_gateway, tmp_path):
    return await make_gateway(responses_store=str(tmp_path / "responses.sqlite3"))


async def test_previous_response_replays_answer_and_tool_items(stored_gw):
    gw = stored_gw
    gw.fake().script = [ev("", prompt=5), ev("", finish="tool_calls", prompt=5, completion=9, tool_calls=[CALL])]
    first = (await post(gw, instructions="first rules", input="weather in Paris?", tools=[TOOL])).json()
    assert first["store"] is True
    gw.fake().script = tokens("It is sunny.")
    second = (await post(gw, previous_response_id=first["id"], instructions="second rules", tools=[TOOL],
                         input=[{"type": "function_call_output", "call_id": "call_abc", "output": "sunny"}])).json()
    assert second["previous_response_id"] == first["id"]
    assert gw.fake().calls[1].req.messages == (
        {"role": "system", "content": "second rules"},  # instructions are not carried over (OpenAI semantics)
        {"role": "user", "content": "weather in Paris?"},
        {"role": "assistant", "content": None, "tool_calls": [CALL]},
        {"role": "tool", "tool_call_id": "call_abc", "content": "sunny"},
    )
    gw.fake().script = tokens("You are welcome.")
    await post(gw, previous_response_id=second["id"], input="thanks")
    replayed = gw.fake().calls[2].req.messages
    assert replayed[-2:] == ({"role": "assistant", "content": "It is sunny."}, {"role": "user", "content": "thanks"})


async def test_stored_response_get_delete_and_streamed_store(stored_gw):
    gw = stored_gw
    gw.fake().script = tokens("streamed", " answer")
    events = await stream(gw)
    final = check_grammar(events)
    got = await gw.client.get(f"/v1/responses/{final['id']}")
    assert got.status_code == 200 and got.json() == final
    deleted = await gw.client.delete(f"/v1/responses/{final['id']}")
    assert deleted.json() == {"id": final["id"], "object": "response", "deleted": True}
    assert_error(await gw.client.get(f"/v1/responses/{final['id']}"), 404, "invalid_request", "response_id")
    assert_error(await post(gw, previous_response_id=final["id"]), 400, "invalid_request", "previous_response_id")


async def test_store_false_is_not_stored(stored_gw):
    body = (await post(stored_gw, store=False)).json()
    assert body["store"] is False
    assert (await stored_gw.client.get(f"/v1/responses/{body['id']}")).status_code == 404


async def test_client_disconnect_cancels_the_generation(gw):
    gw.fake().script = [ev("a", prompt=1), HANG]
    exchange, run = raw_call(gw.app, "/v1/responses", {"model": MODEL, "input": "hi", "stream": True})
    task = asyncio.ensure_future(run())
    await asyncio.wait_for(exchange.first_body.wait(), 5)
    exchange.disconnect.set()
    await asyncio.wait_for(task, 5)
    call = gw.fake().calls[0]
    assert call.cancelled and call.closed
    assert b"response.created" in b"".join(exchange.chunks)




async def test_a_choice_closed_with_error_is_failed_not_completed(gw):
    gw.fake().script = [ev("par", prompt=2), ev("", finish="error", prompt=2, completion=1)]
    events = await stream(gw)
    final = check_grammar(events)
    assert events[-1]["type"] == "response.failed" and final["error"]["code"] == "inference_error"
    gw.fake().script = [ev("", finish="error", prompt=2, completion=1)]
    assert_error(await post(gw), 500, "inference_error")


async def test_a_prompt_too_long_names_input_not_messages(gw):
    """The engine knows the conversation as `messages`; a Response's client sent it as `input` (docs/contract.md,
    "Decisions" 7: the field actually at fault)."""
    for stream in (False, True):
        gw.fake().script = [worker_error("context_exceeded", "prompt has 3031 tokens; this model accepts at most 2047",
                                         param="messages")]
        resp = await post(gw, stream=stream)
        assert_error(resp, 400, "context_exceeded", "input", "context_length_exceeded")
    gw.fake().script = [worker_error("context_exceeded", "too long", param="messages")]
    assert_error(await gw.chat(), 400, "context_exceeded", "messages", "context_length_exceeded")


async def test_a_response_echoes_the_sampling_it_ran_with(make_gateway):
    """A request that sets no temperature / top_p runs with the profile's default_sampling: that is what is echoed
    (OpenAI echoes the values used), not 1.0."""
    def setup(fakes):
        fakes["a"].models = [(TRITON_MODEL, "READY",
                              {**BASE_PARAMS, "default_sampling": '{"temperature": 0.2, "top_p": 0.9}'})]

    gw = await make_gateway(setup=setup)
    body = (await post(gw)).json()
    assert (body["temperature"], body["top_p"]) == (0.2, 0.9)
    assert gw.calls[0].req.temperature is None  # the engine applies its default; the gateway only echoes it
    body = (await post(gw, temperature=0.7, top_p=0.5)).json()
    assert (body["temperature"], body["top_p"]) == (0.7, 0.5)
    plain = await make_gateway()  # a profile without defaults: OpenAI's 1.0
    body = (await post(plain)).json()
    assert (body["temperature"], body["top_p"]) == (1.0, 1.0)
