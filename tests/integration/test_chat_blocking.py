"""Blocking chat completions (docs/contract.md, "Chat completions: responses") through the real app and a fake
Triton."""

from __future__ import annotations

import re
import time

import pytest

from tests.integration.conftest import MODEL, SIE_MODEL, TRITON_MODEL, ev, tokens

FINGERPRINT = re.compile(r"^fp_[0-9a-f]{16}$")
CALL = {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city":"Oslo"}'}}
TOOL = {"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}
LOGPROB = {"token": "Hi", "logprob": -0.5, "bytes": [72, 105], "top_logprobs": []}


async def test_shape_ids_and_usage(gw):
    gw.fake().script = tokens("Hello", " world", prompt=9)
    before = int(time.time())
    resp = await gw.chat(max_tokens=20)
    assert resp.status_code == 200, resp.text
    assert resp.headers["content-type"].startswith("application/json")
    body = resp.json()
    request_id = resp.headers["x-sie-request-id"]
    assert body["id"] == f"chatcmpl-{request_id}"
    assert body["object"] == "chat.completion"
    assert before <= body["created"] <= int(time.time())
    assert body["model"] == MODEL
    assert FINGERPRINT.match(body["system_fingerprint"])
    assert body["choices"] == [{
        "index": 0,
        "message": {"role": "assistant", "content": "Hello world"},
        "logprobs": None,
        "finish_reason": "stop",
    }]
    assert body["usage"] == {"prompt_tokens": 9, "completion_tokens": 2, "total_tokens": 11,
        "prompt_tokens_details": {"cached_tokens": 0}}
    # what reached the model: the Triton name, the messages, the field that set the cap
    (call,) = gw.calls
    assert call.triton_model == TRITON_MODEL
    assert call.request_id == request_id
    assert call.req.messages == ({"role": "user", "content": "hi"},)
    assert call.req.max_tokens == 20 and call.req.stream is False
    assert call.completed and call.closed and not call.cancelled


async def test_sie_safe_model_id_answers_with_canonical_id_and_stable_fingerprint(gw):
    first = (await gw.chat(model=SIE_MODEL)).json()
    second = (await gw.chat()).json()
    assert first["model"] == second["model"] == MODEL
    assert first["system_fingerprint"] == second["system_fingerprint"]
    assert first["id"] != second["id"]


async def test_n_choices_each_closed_and_usage_summed(gw):
    gw.fake().script = [
        ev("A", index=0, prompt=4), ev("B", index=1, prompt=4),
        ev("a", index=0, finish="stop", prompt=4, completion=2),
        ev("bb", index=1, finish="length", prompt=4, completion=3),
    ]
    body = (await gw.chat(n=2)).json()
    assert [c["index"] for c in body["choices"]] == [0, 1]
    assert body["choices"][0]["message"] == {"role": "assistant", "content": "Aa"}
    assert body["choices"][1]["message"] == {"role": "assistant", "content": "Bbb"}
    assert [c["finish_reason"] for c in body["choices"]] == ["stop", "length"]
    # completion tokens add up over the choices; the prompt counts once
    assert body["usage"] == {"prompt_tokens": 4, "completion_tokens": 5, "total_tokens": 9,
        "prompt_tokens_details": {"cached_tokens": 0}}
    assert gw.calls[0].req.n == 2


async def test_logprobs_object_when_requested(gw):
    gw.fake().script = [ev("Hi", logprobs=[LOGPROB]), ev("", finish="stop", prompt=3, completion=1)]
    body = (await gw.chat(logprobs=True, top_logprobs=2)).json()
    assert body["choices"][0]["logprobs"] == {"content": [LOGPROB], "refusal": None}
    assert gw.calls[0].req.logprobs is True and gw.calls[0].req.top_logprobs == 2


async def test_logprobs_null_when_not_requested(gw):
    gw.fake().script = [ev("Hi", logprobs=[LOGPROB]), ev("", finish="stop", prompt=3, completion=1)]
    body = (await gw.chat()).json()
    assert body["choices"][0]["logprobs"] is None


@pytest.mark.parametrize(
    ("native", "expected"),
    [("stop", "stop"), ("length", "length"), ("cancelled", "stop"), ("error", "stop"),
     ("something_new", "stop"), ("content_filter", "content_filter")],
)
async def test_finish_reason_mapping(gw, native, expected):
    gw.fake().script = tokens("x", finish=native)
    body = (await gw.chat()).json()
    assert body["choices"][0]["finish_reason"] == expected


async def test_tool_call_nulls_content(gw):
    gw.fake().script = [ev('{"name"'), ev("", finish="tool_calls", prompt=7, completion=6, tool_calls=[CALL])]
    body = (await gw.chat(tools=[TOOL])).json()
    choice = body["choices"][0]
    assert choice["message"] == {"role": "assistant", "content": None, "tool_calls": [CALL]}
    assert choice["finish_reason"] == "tool_calls"
    assert body["usage"]["completion_tokens"] == 6


async def test_length_truncated_candidate_with_tool_call_reports_tool_calls(gw):
    gw.fake().script = [ev("", finish="length", prompt=7, completion=6, tool_calls=[CALL])]
    body = (await gw.chat(tools=[TOOL])).json()
    assert body["choices"][0]["finish_reason"] == "tool_calls"
    assert body["choices"][0]["message"]["content"] is None


async def test_parameters_reach_the_model(gw):
    await gw.chat(temperature=0.2, top_p=0.9, seed=-3, stop=["\n"], lora_adapter="sql", max_completion_tokens=7,
                  max_tokens=100, routing_key="user-1")
    req = gw.calls[0].req
    params = req.sampling_parameters()
    assert params["max_tokens"] == 7  # max_completion_tokens wins
    assert params["temperature"] == 0.2 and params["top_p"] == 0.9 and params["seed"] == -3
    assert params["stop"] == ["\n"] and params["lora_adapter"] == "sql"
