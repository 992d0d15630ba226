"""SIE-native generate: blocking body and GenerateChunk SSE (docs/contract.md, "Native generate: responses")."""

from __future__ import annotations

import re

import msgpack
import pytest

from gateway.errors import worker_error
from tests.helpers.sse import DONE, parse_sse
from tests.integration.conftest import (
    BASE_PARAMS,
    HANG,
    MODEL,
    SIE_MODEL,
    TRITON_MODEL,
    Delay,
    assert_error,
    ev,
    tokens,
)

LOGPROB = {"token": "Hi", "logprob": -0.5, "bytes": [72, 105], "top_logprobs": []}


async def test_blocking_body(gw):
    gw.fake().script = [ev("Once", prompt=4), Delay(0.02), ev(" more", prompt=4), Delay(0.02),
                        ev(" time", finish="length", prompt=4, completion=3)]
    resp = await gw.generate(max_new_tokens=3)
    assert resp.status_code == 200, resp.text
    assert resp.headers["content-type"].startswith("application/json")
    body = resp.json()
    assert set(body) == {"model", "text", "finish_reason", "usage", "attempt_id", "ttft_ms", "tpot_ms"}
    assert body["model"] == MODEL  # canonical, not the __ path form
    assert body["text"] == "Once more time"
    assert body["finish_reason"] == "length"
    assert body["usage"] == {"prompt_tokens": 4, "completion_tokens": 3, "total_tokens": 7}
    assert isinstance(body["attempt_id"], str) and body["attempt_id"]
    assert isinstance(body["ttft_ms"], float) and body["ttft_ms"] >= 0
    assert isinstance(body["tpot_ms"], float) and body["tpot_ms"] >= 10  # two ~20 ms gaps over 2 tokens
    (call,) = gw.calls
    assert call.triton_model == TRITON_MODEL
    assert call.req.prompt == "Once upon" and call.req.messages is None
    assert call.req.max_tokens == 3 and call.req.stream is False
    assert call.request_id == resp.headers["x-sie-request-id"]


async def test_blocking_single_token_has_numeric_fields(gw):
    gw.fake().script = tokens("x", prompt=1)
    body = (await gw.generate()).json()
    assert body["usage"] == {"prompt_tokens": 1, "completion_tokens": 1, "total_tokens": 2}
    assert "attempt_id" in body and "ttft_ms" in body and "tpot_ms" in body


async def test_stream_sequence(gw):
    gw.fake().script = tokens("a", "b", "c", prompt=2)
    resp = await gw.generate(stream=True)
    assert resp.status_code == 200
    assert resp.headers["content-type"].startswith("text/event-stream")
    assert resp.headers["cache-control"] == "no-cache"
    assert resp.headers["x-accel-buffering"] == "no"
    request_id = resp.headers["x-sie-request-id"]
    items = parse_sse(resp.text)
    assert items[-1] == DONE and items.count(DONE) == 1
    events = items[:-1]
    assert [e["seq"] for e in events] == list(range(len(events)))
    assert all(e["request_id"] == request_id for e in events)
    *deltas, terminal = events
    assert [(e["text_delta"], e["done"]) for e in deltas] == [("a", False), ("b", False), ("c", False)]
    assert all(set(e) == {"request_id", "seq", "text_delta", "done"} for e in deltas)
    assert terminal["done"] is True and terminal["text_delta"] == ""
    assert terminal["finish_reason"] == "stop"
    assert terminal["usage"] == {"prompt_tokens": 2, "completion_tokens": 3, "total_tokens": 5}
    assert isinstance(terminal["ttft_ms"], float)
    assert "error" not in terminal


async def test_stream_logprobs(gw):
    gw.fake().script = [ev("Hi", logprobs=[LOGPROB]), ev("", finish="stop", prompt=1, completion=1)]
    items = parse_sse((await gw.generate(stream=True, logprobs=True, top_logprobs=1)).text)
    assert items[0]["logprobs"] == [LOGPROB]
    assert gw.calls[0].req.logprobs is True


async def test_stream_worker_error_terminal(gw):
    gw.fake().script = [ev("a", prompt=4, completion=1), ev("b", prompt=4, completion=2),
                        worker_error("grammar_invalid", "bad grammar", param="grammar", usage=(4, 3))]
    resp = await gw.generate(stream=True)
    items = parse_sse(resp.text)
    assert items[-1] == DONE and items.count(DONE) == 1
    *deltas, terminal = items[:-1]
    assert [d["text_delta"] for d in deltas] == ["a", "b"]
    ttft_ms = terminal.pop("ttft_ms")  # a worker error terminal carries the terminal's fields (2.6)
    assert isinstance(ttft_ms, float) and ttft_ms >= 0
    assert terminal == {"request_id": resp.headers["x-sie-request-id"], "seq": 2, "text_delta": "", "done": True,
                        "finish_reason": "error",
                        "error": {"message": "bad grammar", "param": "grammar", "code": "grammar_invalid"},
                        # the model's count: a third token was made, not yet streamed
                        "usage": {"prompt_tokens": 4, "completion_tokens": 3, "total_tokens": 7}}


async def test_stream_worker_error_terminal_without_the_models_count_uses_the_streams(gw):
    gw.fake().script = [ev("a", prompt=4, completion=1), ev("b", prompt=4, completion=2),
                        worker_error("inference_error", "the engine failed")]
    terminal = parse_sse((await gw.generate(stream=True)).text)[-2]
    assert terminal["finish_reason"] == "error"
    assert terminal["usage"] == {"prompt_tokens": 4, "completion_tokens": 2, "total_tokens": 6}


async def test_stream_resource_exhausted_carries_retry_after(gw):
    gw.fake().script = [ev("a"), worker_error("RESOURCE_EXHAUSTED", "out of KV cache")]
    items = parse_sse((await gw.generate(stream=True)).text)
    assert items[-2]["error"] == {"message": "out of KV cache", "param": None, "code": "RESOURCE_EXHAUSTED",
                                  "retry_after_s": 5}


async def test_stream_inter_chunk_timeout_terminal(make_gateway):
    gw = await make_gateway(inter_chunk_timeout_s=0.1, keepalive_interval_s=5)
    gw.fake().script = [ev("a"), HANG]
    items = parse_sse((await gw.generate(stream=True)).text)
    assert items[-1] == DONE
    terminal = items[-2]
    # a gateway-synthesized error: the contract's shape, seq 0 whatever came before (2.6)
    assert terminal == {"request_id": items[0]["request_id"], "seq": 0, "text_delta": "", "done": True,
                        "finish_reason": "error",
                        "error": {"code": "inter_chunk_timeout", "message": "no output from the model in time"}}
    assert items[0]["seq"] == 0 and items[0]["text_delta"] == "a"
    assert gw.calls[0].cancelled


async def test_blocking_worker_error_names_the_attempt_like_a_success(gw):
    ok = await gw.generate()
    gw.fake().script = [ev("a"), worker_error("grammar_invalid", "bad grammar", param="grammar")]
    failed = await gw.generate()
    err = assert_error(failed, 400, "grammar_invalid", "grammar")
    request_id = failed.headers["x-sie-request-id"]
    assert err["attempt_id"] == f"{request_id}.a"
    assert ok.json()["attempt_id"] == f"{ok.headers['x-sie-request-id']}.a"


async def test_stream_error_before_first_event_is_http_error(gw):
    gw.fake().script = [worker_error("context_exceeded", "prompt too long", param="prompt")]
    resp = await gw.generate(stream=True)
    assert resp.status_code == 400
    assert resp.headers["content-type"].startswith("application/json")
    # a worker error names its attempt (docs/contract.md, "Errors"), like the blocking body's attempt_id
    assert resp.json() == {"error": {"message": "prompt too long", "type": "context_length_exceeded",
                                     "param": "prompt", "code": "context_exceeded",
                                     "attempt_id": f"{resp.headers['x-sie-request-id']}.a"}}


async def test_keepalive_on_native_stream(make_gateway):
    gw = await make_gateway(keepalive_interval_s=0.05)
    gw.fake().script = [ev("a"), Delay(0.2), ev("b", finish="stop", completion=2)]
    text = (await gw.generate(stream=True)).text
    assert ": keep-alive\n\n" in text
    assert text.index(": keep-alive") > text.index('"text_delta":"a"')
    assert text.endswith("data: [DONE]\n\n")


async def test_dotted_canonical_id_accepted_in_path(gw):
    resp = await gw.generate(model="acme__Tiny-1_dot_5B-Instruct")
    assert resp.status_code == 200, resp.text
    assert resp.json()["model"] == MODEL
    resp = await gw.generate(model=SIE_MODEL)
    assert resp.status_code == 200, resp.text


async def test_a_buffered_answer_names_the_model_config_that_answered_it(gw):
    """`X-SIE-Model-Revision`: lowercase 64-hex, the same for the same config, another for another; SSE omits it
    (docs/contract.md, "Response headers")."""
    first, again = await gw.generate(), await gw.generate()
    revision = first.headers["x-sie-model-revision"]
    assert re.fullmatch(r"[0-9a-f]{64}", revision) and again.headers["x-sie-model-revision"] == revision
    assert "x-sie-model-revision" not in (await gw.generate(stream=True)).headers
    gw.fake().models = [(TRITON_MODEL, "READY", {**BASE_PARAMS, "max_output_tokens": "1024"})]
    await gw.registry.refresh()
    changed = (await gw.generate()).headers["x-sie-model-revision"]
    assert re.fullmatch(r"[0-9a-f]{64}", changed) and changed != revision


async def test_every_buffered_route_names_the_model_config(gw):
    revision = (await gw.generate()).headers["x-sie-model-revision"]
    assert (await gw.chat()).headers["x-sie-model-revision"] == revision
    assert "x-sie-model-revision" not in (await gw.chat(stream=True)).headers
    completion = await gw.client.post("/v1/completions", json={"model": MODEL, "prompt": "x"})
    assert completion.headers["x-sie-model-revision"] == revision


async def test_msgpack_in_and_out_on_the_native_route(gw):
    """The SDK's client default content type is msgpack; the gateway answers msgpack to a msgpack Accept."""
    body = msgpack.packb({"prompt": "Once upon", "max_new_tokens": 4})
    resp = await gw.client.post(f"/v1/generate/{SIE_MODEL}", content=body,
                                headers={"Content-Type": "application/msgpack", "Accept": "application/msgpack"})
    assert resp.status_code == 200 and resp.headers["content-type"] == "application/msgpack"
    answer = msgpack.unpackb(resp.content)
    assert answer["text"] == "Hello world" and answer["attempt_id"] and answer["usage"]["total_tokens"] > 0
    assert gw.calls[-1].req.prompt == "Once upon"
    as_json = await gw.client.post(f"/v1/generate/{SIE_MODEL}", content=body,
                                   headers={"Content-Type": "application/msgpack", "Accept": "*/*"})
    assert as_json.json()["text"] == "Hello world"  # msgpack only when asked for


@pytest.mark.parametrize("payload", [
    b"\xc1",  # never used
    msgpack.packb({1: "x"}),
    msgpack.packb({"prompt": b"bytes", "max_new_tokens": 4}),
    msgpack.packb({"prompt": "x", "max_new_tokens": 4, "temperature": float("nan")}),
    msgpack.packb({"prompt": "x", "max_new_tokens": 4, "x": [[[[[[[[[[[[[[[[1]]]]]]]]]]]]]]]]}),
    msgpack.packb(["not", "an", "object"]),
    b"\xd6\xff\x00\x00\x00\x00",  # a timestamp ext
])
async def test_msgpack_that_json_could_not_carry_is_a_400(gw, payload):
    resp = await gw.client.post(f"/v1/generate/{SIE_MODEL}", content=payload,
                                headers={"Content-Type": "application/msgpack"})
    assert resp.status_code == 400 and resp.json()["error"]["type"] == "invalid_request_error", resp.text
    assert not gw.calls
