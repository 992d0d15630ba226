"""Streaming chat SSE (docs/contract.md, "Chat completions: responses"): framing, per-choice state, usage frame, in-band
errors."""

from __future__ import annotations

import re

from gateway.errors import worker_error
from tests.helpers.sse import DONE, Comment, data_events, parse_sse
from tests.integration.conftest import HANG, MODEL, Delay, ev, tokens

FINGERPRINT = re.compile(r"^fp_[0-9a-f]{16}$")
HEAD_KEYS = {"id", "object", "created", "model", "system_fingerprint", "choices"}
TOOL = {"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}
CALL = {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city":"Oslo"}'}}
LOGPROB = {"token": "Hi", "logprob": -0.5, "bytes": [72, 105], "top_logprobs": []}


async def stream_chat(gw, **body):
    resp = await gw.chat(stream=True, **body)
    assert resp.status_code == 200, resp.text
    return resp, parse_sse(resp.text)


def choice(chunk):
    (only,) = chunk["choices"]
    return only


def assert_common_head(chunks, request_id):
    assert {c["id"] for c in chunks} == {f"chatcmpl-{request_id}"}
    assert len({c["created"] for c in chunks}) == 1
    for c in chunks:
        assert c["object"] == "chat.completion.chunk"
        assert c["model"] == MODEL
        assert FINGERPRINT.match(c["system_fingerprint"])


async def test_single_choice_stream_exact_sequence(gw):
    gw.fake().script = tokens("Hel", "lo", prompt=3)
    resp, items = await stream_chat(gw)
    assert resp.headers["content-type"].startswith("text/event-stream")
    assert resp.headers["cache-control"] == "no-cache"
    assert resp.headers["x-accel-buffering"] == "no"
    assert resp.headers["x-sie-server-version"]
    assert items[-1] == DONE and items.count(DONE) == 1
    chunks = items[:-1]
    assert all(set(c) == HEAD_KEYS for c in chunks)
    assert_common_head(chunks, resp.headers["x-sie-request-id"])
    assert [choice(c) for c in chunks] == [
        {"index": 0, "delta": {"role": "assistant", "content": "Hel"}, "logprobs": None, "finish_reason": None},
        {"index": 0, "delta": {"content": "lo"}, "logprobs": None, "finish_reason": None},
        {"index": 0, "delta": {}, "logprobs": None, "finish_reason": "stop"},
    ]
    assert gw.calls[0].req.stream is True


async def test_n_choices_role_once_each_and_per_index_closures(gw):
    gw.fake().script = [
        ev("A", index=0, prompt=4), ev("B", index=1, prompt=4),
        ev("a", index=0, finish="stop", prompt=4, completion=2),
        ev("b", index=1, finish="length", prompt=4, completion=3),
    ]
    resp, items = await stream_chat(gw, n=2, stream_options={"include_usage": True})
    assert items[-1] == DONE and items.count(DONE) == 1
    *chunks, usage = items[:-1]
    assert_common_head(chunks + [usage], resp.headers["x-sie-request-id"])
    for index in (0, 1):
        mine = [choice(c) for c in chunks if choice(c)["index"] == index]
        assert sum("role" in c["delta"] for c in mine) == 1 and "role" in mine[0]["delta"]
        assert "".join(c["delta"].get("content", "") for c in mine) == ("Aa" if index == 0 else "Bb")
        finishes = [c["finish_reason"] for c in mine if c["finish_reason"] is not None]
        assert finishes == (["stop"] if index == 0 else ["length"])
        assert mine[-1]["finish_reason"] is not None
    # the usage frame comes after every choice closed, sums completions, counts the prompt once
    assert usage["choices"] == []
    assert usage["usage"] == {"prompt_tokens": 4, "completion_tokens": 5, "total_tokens": 9,
        "prompt_tokens_details": {"cached_tokens": 0}}
    assert set(usage) == HEAD_KEYS | {"usage"}


async def test_no_usage_frame_without_include_usage(gw):
    _, items = await stream_chat(gw)
    assert all("usage" not in c for c in items[:-1])
    _, items = await stream_chat(gw, stream_options={"include_usage": False})
    assert all("usage" not in c for c in items[:-1])


async def test_usage_frame_is_last_before_done(gw):
    gw.fake().script = tokens("a", "b", "c", prompt=2)
    _, items = await stream_chat(gw, stream_options={"include_usage": True})
    assert items[-1] == DONE
    assert items[-2]["choices"] == [] and items[-2]["usage"] == {
        "prompt_tokens": 2, "completion_tokens": 3, "total_tokens": 5, "prompt_tokens_details": {"cached_tokens": 0}}
    assert choice(items[-3])["finish_reason"] == "stop"


async def test_mid_stream_worker_error_is_in_band_then_done(gw):
    gw.fake().script = [ev("a"), ev("b"), worker_error("inference_error", "the engine failed")]
    resp, items = await stream_chat(gw, stream_options={"include_usage": True})
    assert items[-1] == DONE and items.count(DONE) == 1
    *chunks, error = items[:-1]
    assert [choice(c)["delta"].get("content") for c in chunks] == ["a", "b"]
    assert all(choice(c)["finish_reason"] is None for c in items[:-1])  # never "stop"
    assert choice(error) == {"index": 0, "delta": {}, "logprobs": None, "finish_reason": None}
    assert error["error"] == {"message": "the engine failed", "type": "server_error", "param": None,
                              "code": "inference_error"}
    assert error["request_id"] == resp.headers["x-sie-request-id"]
    assert error["id"] == f"chatcmpl-{resp.headers['x-sie-request-id']}"
    assert not any("usage" in c for c in items[:-1])  # no usage frame after a failure


async def test_mid_stream_context_exceeded_keeps_openai_type(gw):
    gw.fake().script = [ev("a"), worker_error("context_exceeded", "too long", param="messages")]
    _, items = await stream_chat(gw)
    assert items[-2]["error"] == {"message": "too long", "type": "context_length_exceeded",
                                  "param": "messages", "code": "context_exceeded"}


async def test_error_before_first_event_is_plain_http_error(gw):
    gw.fake().script = [worker_error("QUEUE_FULL", "queue is full")]
    resp = await gw.chat(stream=True)
    assert resp.status_code == 503
    assert resp.headers["content-type"].startswith("application/json")
    assert resp.headers["retry-after"] == "1"
    assert resp.headers["x-sie-error-code"] == "QUEUE_FULL"
    assert resp.json()["error"]["code"] == "QUEUE_FULL"
    assert "cache-control" not in resp.headers


async def test_keepalive_comments_while_model_is_silent(make_gateway):
    gw = await make_gateway(keepalive_interval_s=0.05)
    gw.fake().script = [ev("a", prompt=1), Delay(0.3), ev("b", finish="stop", prompt=1, completion=2)]
    _, items = await stream_chat(gw)
    kinds = ["comment" if isinstance(i, Comment) else i for i in items]
    first_comment = kinds.index("comment")
    assert first_comment == 1  # after the first chunk, before the next
    assert sum(isinstance(i, Comment) for i in items) >= 2
    assert all(i.text == "keep-alive" for i in items if isinstance(i, Comment))
    chunks = data_events(items)
    assert [choice(c)["delta"].get("content") for c in chunks[:-1]] == ["a", "b", None]
    assert chunks[-1] == DONE


async def test_no_keepalive_when_tokens_flow(make_gateway):
    gw = await make_gateway(keepalive_interval_s=5)
    _, items = await stream_chat(gw)
    assert not any(isinstance(i, Comment) for i in items)


async def test_inter_chunk_timeout_is_in_band_and_cancels_upstream(make_gateway):
    gw = await make_gateway(inter_chunk_timeout_s=0.1, keepalive_interval_s=5)
    gw.fake().script = [ev("a"), HANG]
    _, items = await stream_chat(gw)
    assert items[-1] == DONE
    error = items[-2]
    assert choice(error) == {"index": 0, "delta": {}, "logprobs": None, "finish_reason": None}
    assert error["error"]["code"] == "inter_chunk_timeout"
    assert error["error"]["type"] == "server_error"
    (call,) = gw.calls
    assert call.cancelled and call.closed


async def test_logprobs_in_chunks(gw):
    gw.fake().script = [ev("Hi", logprobs=[LOGPROB]), ev("", finish="stop", prompt=3, completion=1)]
    _, items = await stream_chat(gw, logprobs=True)
    assert choice(items[0])["logprobs"] == {"content": [LOGPROB], "refusal": None}
    assert choice(items[0])["delta"] == {"role": "assistant", "content": "Hi"}


async def test_tool_call_stream(gw):
    gw.fake().script = [ev('{"na'), ev("", finish="tool_calls", prompt=5, completion=4, tool_calls=[CALL])]
    _, items = await stream_chat(gw, tools=[TOOL])
    chunks = items[:-1]
    # the raw call text never leaks as content
    assert not any(choice(c)["delta"].get("content") for c in chunks)
    assert sum("role" in choice(c)["delta"] for c in chunks) == 1
    deltas = [d for c in chunks for d in choice(c)["delta"].get("tool_calls", [])]
    assert deltas == [{"index": 0, "id": "call_1", "type": "function",
                       "function": {"name": "get_weather", "arguments": '{"city":"Oslo"}'}}]
    assert choice(chunks[-1])["finish_reason"] == "tool_calls"
    assert [choice(c)["finish_reason"] for c in chunks].count("tool_calls") == 1


async def test_held_text_is_released_when_no_tool_call(gw):
    gw.fake().script = tokens("plain", " answer")
    _, items = await stream_chat(gw, tools=[TOOL])
    chunks = items[:-1]
    assert "".join(choice(c)["delta"].get("content", "") for c in chunks) == "plain answer"
    assert choice(chunks[-1])["finish_reason"] == "stop"
