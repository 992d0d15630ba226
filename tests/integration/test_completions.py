"""POST /v1/completions through the real app and a fake Triton: shape, prompt arrays, echo, logprobs,
streaming, errors, disconnects, and the request `vllm bench serve` sends."""

from __future__ import annotations

import asyncio
import re
import time
from typing import Any

import pytest

from gateway.errors import worker_error
from tests.helpers.prometheus import metric_value
from tests.helpers.sse import DONE, data_events, parse_sse
from tests.integration.conftest import (
    HANG,
    MODEL,
    SIE_MODEL,
    TRITON_MODEL,
    Delay,
    assert_error,
    assert_sie_headers,
    ev,
    raw_call,
    tokens,
)

FINGERPRINT = re.compile(r"^fp_[0-9a-f]{16}$")
HEAD_KEYS = {"id", "object", "created", "model", "system_fingerprint", "choices"}
PATH = "/v1/completions"


async def complete(gw, headers: dict[str, str] | None = None, **body: Any):
    payload = {"model": MODEL, "prompt": "Once upon", **body}
    return await gw.client.post(PATH, json=payload, headers=headers)


async def stream(gw, **body: Any) -> tuple[Any, list[Any]]:
    resp = await complete(gw, stream=True, **body)
    assert resp.status_code == 200, resp.text
    assert resp.headers["content-type"].startswith("text/event-stream")
    items = data_events(parse_sse(resp.text))
    assert items[-1] == DONE and items.count(DONE) == 1
    return resp, items[:-1]


def per_prompt(req) -> list[Any]:
    """Each engine request answers with its own prompt, upper-cased, in n choices; prompt tokens = words."""
    prompt_tokens = len(req.prompt.split())
    out: list[Any] = []
    for j in range(req.n):
        out += [ev(f"{req.prompt.upper()}", index=j, prompt=prompt_tokens),
                ev(f"/{j}", index=j, finish="length" if j else "stop", prompt=prompt_tokens, completion=2 + j)]
    return out


def sampling(req) -> dict[str, Any]:
    """The sampling_parameters the engine gets, without the keys that only say which field set the cap."""
    return {k: v for k, v in req.sampling_parameters().items() if k not in ("max_tokens_param", "clamp_max_tokens")}


def single(chunk: dict[str, Any]) -> dict[str, Any]:
    (only,) = chunk["choices"]
    return only


# -- blocking -------------------------------------------------------------------------------------

async def test_blocking_shape_ids_usage_and_what_reached_the_model(gw):
    gw.fake().script = tokens("Hello", " world", prompt=9)
    before = int(time.time())
    resp = await complete(gw)
    assert resp.status_code == 200, resp.text
    assert_sie_headers(resp)
    body = resp.json()
    request_id = resp.headers["x-sie-request-id"]
    assert set(body) == HEAD_KEYS | {"usage"}
    assert body["id"] == f"cmpl-{request_id}"
    assert body["object"] == "text_completion"
    assert before <= body["created"] <= int(time.time())
    assert body["model"] == MODEL
    assert FINGERPRINT.match(body["system_fingerprint"])
    assert body["choices"] == [{"index": 0, "text": "Hello world", "logprobs": None, "finish_reason": "stop"}]
    assert body["usage"] == {"prompt_tokens": 9, "completion_tokens": 2, "total_tokens": 11,
        "prompt_tokens_details": {"cached_tokens": 0}}
    (call,) = gw.calls
    assert call.triton_model == TRITON_MODEL and call.request_id == request_id
    # raw text, no chat template; OpenAI's default cap of 16 tokens
    assert call.req.prompt == "Once upon" and call.req.messages is None
    assert call.req.max_tokens == 16 and call.req.max_tokens_param == "max_tokens" and not call.req.stream
    assert call.completed and call.closed and not call.cancelled


async def test_sampling_fields_reach_the_engine_and_user_does_not(gw):
    resp = await complete(gw, max_tokens=40, temperature=0.5, top_p=0.9, top_k=5, min_tokens=3,
                          repetition_penalty=1.1, presence_penalty=0.2, frequency_penalty=-0.2, seed=7,
                          stop=["\n"], logit_bias={"42": -100}, user="alice@example.com", ignore_eos=True,
                          lora_adapter="sql")
    assert resp.status_code == 200, resp.text
    params = sampling(gw.calls[0].req)
    assert params == {
        "max_tokens": 40, "n": 1, "temperature": 0.5, "top_p": 0.9, "top_k": 5, "min_tokens": 3,
        "repetition_penalty": 1.1, "presence_penalty": 0.2, "frequency_penalty": -0.2, "seed": 7,
        "lora_adapter": "sql", "logit_bias": {"42": -100.0}, "stop": ["\n"], "ignore_eos": True,
    }
    assert "alice" not in repr(gw.calls[0].req)


async def test_sie_safe_model_id_answers_with_canonical_id(gw):
    assert (await complete(gw, model=SIE_MODEL)).json()["model"] == MODEL


async def test_n_choices_and_finish_reasons(gw):
    gw.fake().script = per_prompt
    body = (await complete(gw, n=2)).json()
    assert [(c["index"], c["text"], c["finish_reason"]) for c in body["choices"]] == [
        (0, "ONCE UPON/0", "stop"), (1, "ONCE UPON/1", "length")]
    assert body["usage"] == {"prompt_tokens": 2, "completion_tokens": 5, "total_tokens": 7,
        "prompt_tokens_details": {"cached_tokens": 0}}
    assert len(gw.calls) == 1 and gw.calls[0].req.n == 2


async def test_prompt_array_fans_out_one_engine_request_per_prompt(gw):
    gw.fake().script = per_prompt
    resp = await complete(gw, prompt=["a b c", "d"], n=2)
    assert resp.status_code == 200, resp.text
    body = resp.json()
    # OpenAI's numbering: choice index = prompt index * n + candidate
    assert [(c["index"], c["text"], c["finish_reason"]) for c in body["choices"]] == [
        (0, "A B C/0", "stop"), (1, "A B C/1", "length"), (2, "D/0", "stop"), (3, "D/1", "length")]
    # each engine request counts its own prompt: usage sums them, and every candidate's tokens
    assert body["usage"] == {"prompt_tokens": 3 + 1, "completion_tokens": 5 + 5, "total_tokens": 14,
        "prompt_tokens_details": {"cached_tokens": 0}}
    assert sorted(c.req.prompt for c in gw.calls) == ["a b c", "d"]
    assert all(c.req.n == 2 and c.completed and c.closed for c in gw.calls)
    request_id = resp.headers["x-sie-request-id"]
    assert body["id"] == f"cmpl-{request_id}"
    assert len({c.request_id for c in gw.calls}) == 2  # each engine request has its own Triton id
    assert gw.registry.endpoints[0].outstanding == 0


async def test_echo_prepends_the_prompt_to_every_choice(gw):
    gw.fake().script = per_prompt
    body = (await complete(gw, prompt=["x", "y"], echo=True)).json()
    assert [c["text"] for c in body["choices"]] == ["xX/0", "yY/0"]


async def test_logprobs_legacy_object(gw):
    lp = [
        {"token": "Hel", "logprob": -0.5, "bytes": [72, 101, 108],
         "top_logprobs": [{"token": "Hel", "logprob": -0.5, "bytes": []},
                          {"token": "Hi", "logprob": -1.5, "bytes": []}]},
        {"token": "lo", "logprob": -0.25, "bytes": [108, 111],
         "top_logprobs": [{"token": "p", "logprob": -0.1, "bytes": []}, {"token": "x", "logprob": -3.0, "bytes": []}]},
    ]
    gw.fake().script = [ev("Hel", logprobs=lp[:1], prompt=2), ev("lo", finish="stop", logprobs=lp[1:], prompt=2,
                                                               completion=2)]
    body = (await complete(gw, logprobs=2)).json()
    (choice,) = body["choices"]
    assert choice["text"] == "Hello"
    assert choice["logprobs"] == {
        "tokens": ["Hel", "lo"],
        "token_logprobs": [-0.5, -0.25],
        # the top tokens, and always the sampled one (up to logprobs + 1 entries)
        "top_logprobs": [{"Hel": -0.5, "Hi": -1.5}, {"p": -0.1, "x": -3.0, "lo": -0.25}],
        "text_offset": [0, 3],
    }
    req = gw.calls[0].req
    assert req.logprobs is True and req.top_logprobs == 2


async def test_logprobs_zero_still_gives_the_object(gw):
    gw.fake().script = [ev("a", finish="stop", prompt=1, completion=1,
                           logprobs=[{"token": "a", "logprob": -1.0, "bytes": [97], "top_logprobs": []}])]
    (choice,) = (await complete(gw, logprobs=0)).json()["choices"]
    assert choice["logprobs"] == {"tokens": ["a"], "token_logprobs": [-1.0], "top_logprobs": [{"a": -1.0}],
                                  "text_offset": [0]}
    assert gw.calls[0].req.logprobs is True and gw.calls[0].req.top_logprobs == 0


# -- streaming ------------------------------------------------------------------------------------

async def test_stream_exact_sequence_with_usage(gw):
    gw.fake().script = tokens("Hel", "lo", prompt=3)
    resp, chunks = await stream(gw, stream_options={"include_usage": True})
    assert resp.headers["cache-control"] == "no-cache"
    request_id = resp.headers["x-sie-request-id"]
    *text_chunks, usage = chunks
    assert {c["id"] for c in chunks} == {f"cmpl-{request_id}"}
    assert all(set(c) == HEAD_KEYS for c in text_chunks) and all(c["object"] == "text_completion" for c in chunks)
    assert [single(c) for c in text_chunks] == [
        {"index": 0, "text": "Hel", "logprobs": None, "finish_reason": None},
        {"index": 0, "text": "lo", "logprobs": None, "finish_reason": None},
        {"index": 0, "text": "", "logprobs": None, "finish_reason": "stop"},
    ]
    assert usage["choices"] == [] and usage["usage"] == {"prompt_tokens": 3, "completion_tokens": 2,
                                                         "total_tokens": 5,
                                                             "prompt_tokens_details": {"cached_tokens": 0}}
    assert gw.calls[0].req.stream is True


async def test_stream_without_include_usage_has_no_usage_chunk(gw):
    _, chunks = await stream(gw)
    assert all("usage" not in c for c in chunks)


async def test_stream_prompt_array_with_n_and_usage(gw):
    gw.fake().script = per_prompt
    _, chunks = await stream(gw, prompt=["a b c", "d"], n=2, stream_options={"include_usage": True})
    *text_chunks, usage = chunks
    texts: dict[int, str] = {}
    finishes: dict[int, list[str]] = {}
    for chunk in text_chunks:
        c = single(chunk)
        texts[c["index"]] = texts.get(c["index"], "") + c["text"]
        if c["finish_reason"] is not None:
            finishes.setdefault(c["index"], []).append(c["finish_reason"])
    assert texts == {0: "A B C/0", 1: "A B C/1", 2: "D/0", 3: "D/1"}
    assert finishes == {0: ["stop"], 1: ["length"], 2: ["stop"], 3: ["length"]}
    assert usage["usage"] == {"prompt_tokens": 4, "completion_tokens": 10, "total_tokens": 14,
        "prompt_tokens_details": {"cached_tokens": 0}}
    assert all(c.closed and c.completed for c in gw.calls)


async def test_stream_echo_comes_first_once_per_choice(gw):
    gw.fake().script = per_prompt
    _, chunks = await stream(gw, prompt="hi there", echo=True, n=2)
    by_index: dict[int, list[str]] = {}
    for chunk in chunks:
        by_index.setdefault(single(chunk)["index"], []).append(single(chunk)["text"])
    assert by_index == {0: ["hi thereHI THERE", "/0", ""], 1: ["hi thereHI THERE", "/1", ""]}


async def test_stream_logprobs_offsets_continue_across_chunks(gw):
    def entry(token: str) -> dict[str, Any]:
        return {"token": token, "logprob": -1.0, "bytes": list(token.encode()), "top_logprobs": []}

    gw.fake().script = [ev("ab", logprobs=[entry("a"), entry("b")], prompt=1),
                        ev("cd", logprobs=[entry("cd")], finish="length", prompt=1, completion=3)]
    _, chunks = await stream(gw, logprobs=0)
    first, second, closing = (single(c) for c in chunks)
    assert first["logprobs"]["tokens"] == ["a", "b"] and first["logprobs"]["text_offset"] == [0, 1]
    assert second["logprobs"]["tokens"] == ["cd"] and second["logprobs"]["text_offset"] == [2]
    assert closing == {"index": 0, "text": "", "logprobs": None, "finish_reason": "length"}


async def test_stream_error_after_first_token_is_in_band_then_done(gw):
    gw.fake().script = [ev("a", prompt=1), worker_error("inference_error", "boom")]
    resp = await complete(gw, stream=True)
    assert resp.status_code == 200
    items = parse_sse(resp.text)
    assert items[-1] == DONE
    error = items[-2]
    assert error["object"] == "text_completion" and error["error"]["code"] == "inference_error"
    assert error["choices"] == [{"index": 0, "text": "", "logprobs": None, "finish_reason": None}]


async def test_stream_error_in_one_prompt_stops_the_others(gw):
    def script(req):
        if req.prompt == "bad":
            return [ev("x", prompt=1), Delay(0.05), worker_error("inference_error", "boom")]
        return [ev("ok", prompt=1)] + [Delay(0.02), ev("ok", prompt=1)] * 1000

    gw.fake().script = script
    resp = await complete(gw, prompt=["good", "bad"], stream=True)
    items = parse_sse(resp.text)
    assert items[-1] == DONE and items[-2]["error"]["code"] == "inference_error"
    good = next(c for c in gw.calls if c.req.prompt == "good")
    assert good.cancelled and good.closed
    assert gw.registry.endpoints[0].outstanding == 0


# -- the request vllm bench serve sends -----------------------------------------------------------

async def test_vllm_bench_serve_request_is_accepted(gw):
    gw.fake().script = tokens("a", "b", "c", finish="length", prompt=30)
    payload = {"model": MODEL, "prompt": "random words " * 10, "repetition_penalty": 1.0, "max_tokens": 3,
               "logprobs": None, "stream": True, "stream_options": {"include_usage": True}, "ignore_eos": True,
               "temperature": 0.0, "min_tokens": 3}
    resp = await gw.client.post(PATH, json=payload)
    assert resp.status_code == 200, resp.text
    items = data_events(parse_sse(resp.text))
    # what vllm's client reads: choices[0].text per chunk, then usage.completion_tokens from a choice-less chunk
    assert "".join(c["choices"][0]["text"] for c in items[:-1] if c["choices"]) == "abc"
    assert items[-2]["choices"] == [] and items[-2]["usage"]["completion_tokens"] == 3
    params = gw.calls[0].req.sampling_parameters()
    assert params["ignore_eos"] is True and params["min_tokens"] == 3 and "logprobs" not in params


async def test_explicit_nulls_mean_absent(gw):
    nulls = {k: None for k in ("suffix", "max_tokens", "temperature", "top_p", "n", "best_of", "stream",
                               "stream_options", "logprobs", "echo", "stop", "presence_penalty",
                               "frequency_penalty", "logit_bias", "seed", "user", "top_k", "min_tokens",
                               "repetition_penalty", "lora_adapter", "ignore_eos")}
    resp = await complete(gw, **nulls)
    assert resp.status_code == 200, resp.text
    assert sampling(gw.calls[0].req) == {"max_tokens": 16, "n": 1}


# -- errors ---------------------------------------------------------------------------------------

@pytest.mark.parametrize(("body", "code", "param"), [
    ({"suffix": "after"}, "unsupported_field", "suffix"),
    ({"echo": True, "logprobs": 1}, "unsupported_field", "echo"),
    ({"prompt": [1, -2, 3]}, "invalid_request", "prompt[1]"),
    ({"prompt": [[1, 2], [3]], "echo": True}, "unsupported_field", "echo"),
    ({"prompt": ["a", 5]}, "invalid_request", "prompt[1]"),
    ({"logprobs": 6}, "invalid_request", "logprobs"),
    ({"logprobs": True}, "invalid_request", "logprobs"),
    ({"messages": []}, "unsupported_field", "messages"),
    ({"response_format": {"type": "json_object"}}, "unsupported_field", "response_format"),
    ({"best_of": 2, "stream": True}, "unsupported_field", "best_of"),
    ({"n": 3, "best_of": 2}, "invalid_request", "best_of"),
    ({"max_tokens": 0}, "invalid_request", "max_tokens"),
])
async def test_contract_errors_before_dispatch(gw, body, code, param):
    assert_error(await complete(gw, **body), 400, code, param)
    assert not gw.calls


async def test_profile_errors_name_the_field(gw):
    assert_error(await complete(gw, max_tokens=5000), 400, "context_exceeded", "max_tokens",
                 "context_length_exceeded")
    assert_error(await complete(gw, lora_adapter="nope"), 400, "unknown_lora_adapter", "lora_adapter")
    assert_error(await complete(gw, max_tokens=4, min_tokens=8), 400, "invalid_request", "min_tokens")
    assert_error(await complete(gw, model="acme__Missing"), 404, "model_not_found", "model")
    assert not gw.calls


async def test_capacity_error_in_any_prompt_is_a_503_and_releases_the_others(gw):
    def script(req):
        if req.prompt == "second":
            return [worker_error("QUEUE_FULL", "queue is full")]
        return [ev("a", prompt=1), HANG]

    gw.fake().script = script
    resp = await complete(gw, prompt=["first", "second"])
    assert_error(resp, 503, "QUEUE_FULL", None)
    assert resp.headers["retry-after"] == "1"
    assert all(c.closed for c in gw.calls)
    assert next(c for c in gw.calls if c.req.prompt == "first").cancelled
    assert gw.registry.endpoints[0].outstanding == 0


@pytest.mark.parametrize("stream", [False, True])
async def test_first_chunk_timeout_is_504(make_gateway, stream):
    gw = await make_gateway(first_chunk_timeout_s=0.1)
    gw.fake().script = [HANG]
    assert_error(await complete(gw, stream=stream), 504, "first_chunk_timeout", None)
    assert gw.calls[0].cancelled and gw.calls[0].closed


async def test_auth_applies(make_gateway):
    gw = await make_gateway(auth_mode="token", auth_tokens=("tok-one",))
    assert_error(await complete(gw), 401, "UNAUTHORIZED", None)
    assert (await complete(gw, headers={"Authorization": "Bearer tok-one"})).status_code == 200


async def test_metrics_and_openapi(gw):
    def counts(text: str) -> tuple[float, float]:
        return (metric_value(text, "sie_gateway_requests_total", endpoint="completions", status="200"),
                metric_value(text, "sie_gateway_ttft_seconds_count", endpoint="completions"))

    before = counts((await gw.client.get("/metrics")).text)
    await complete(gw)
    await complete(gw, stream=True)
    after = counts((await gw.client.get("/metrics")).text)
    # deltas: the counters are process-wide and earlier tests have already moved them
    assert (after[0] - before[0], after[1] - before[1]) == (2, 2)
    doc = (await gw.client.get("/openapi.json")).json()
    op = doc["paths"]["/v1/completions"]["post"]
    assert op["requestBody"]["content"]["application/json"]["schema"] == {
        "$ref": "#/components/schemas/CompletionRequest"}
    assert "prompt" in doc["components"]["schemas"]["CompletionRequest"]["required"]


# -- disconnects ----------------------------------------------------------------------------------

def endless(req):
    return [ev("tok", prompt=1)] + [Delay(0.02), ev("tok", prompt=1)] * 10_000


@pytest.mark.parametrize("prompt", ["one", ["one", "two"]], ids=["single", "array"])
@pytest.mark.parametrize("streamed", [True, False], ids=["stream", "blocking"])
async def test_disconnect_cancels_every_engine_request(gw, prompt, streamed):
    gw.fake().script = endless
    exchange, run = raw_call(gw.app, PATH, {"model": MODEL, "prompt": prompt, "stream": streamed})
    task = asyncio.ensure_future(run())
    if streamed:
        await asyncio.wait_for(exchange.first_body.wait(), 2)
        assert exchange.status == 200
    else:
        while len(gw.calls) < len(prompt if isinstance(prompt, list) else [prompt]):
            await asyncio.sleep(0.005)
        await asyncio.gather(*(c.first_sent.wait() for c in gw.calls))
        await asyncio.sleep(0.05)
    exchange.disconnect.set()
    done, _ = await asyncio.wait({task}, timeout=2)
    assert task in done and task.exception() is None
    assert gw.calls and all(c.cancelled and c.closed and not c.completed for c in gw.calls)
    assert gw.registry.endpoints[0].outstanding == 0


# -- the request GuideLLM sends -------------------------------------------------------------------

async def test_guidellm_request_gets_usage_on_every_chunk(gw):
    """GuideLLM 0.8.1's openai_http backend: stream_options.continuous_usage_stats, ignore_eos, stop null."""
    gw.fake().script = [ev("a", prompt=30, completion=1), ev("b", prompt=30, completion=2),
                        ev("c", finish="length", prompt=30, completion=3)]
    payload = {"model": MODEL, "prompt": "random words " * 10, "max_tokens": 3, "stream": True, "stop": None,
               "ignore_eos": True, "stream_options": {"include_usage": True, "continuous_usage_stats": True}}
    resp = await gw.client.post(PATH, json=payload)
    assert resp.status_code == 200, resp.text
    items = data_events(parse_sse(resp.text))
    assert items[-1] == DONE
    chunks = items[:-1]
    assert all("usage" in c for c in chunks)
    assert [c["usage"]["completion_tokens"] for c in chunks if c["choices"] and c["choices"][0]["text"]] == [1, 2, 3]
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] == 3
    assert all(c["usage"]["prompt_tokens"] == 30 for c in chunks)


async def test_continuous_usage_without_include_usage_adds_nothing(gw):
    _, chunks = await stream(gw, stream_options={"continuous_usage_stats": True})
    assert all("usage" not in c for c in chunks)


async def test_chat_still_refuses_continuous_usage_stats(gw):
    resp = await gw.chat(stream=True, stream_options={"include_usage": True, "continuous_usage_stats": True})
    assert_error(resp, 400, "unsupported_field", "stream_options.continuous_usage_stats")


async def test_token_id_prompts_reach_the_engine_as_ids(gw):
    gw.fake().script = tokens("Hello", prompt=3)
    resp = await complete(gw, prompt=[504, 3575, 282], max_tokens=2)
    assert resp.status_code == 200, resp.text
    (call,) = gw.calls
    assert (call.req.prompt, call.req.prompt_token_ids) == (None, (504, 3575, 282))
    assert resp.json()["choices"][0]["text"] == "Hello"


async def test_several_token_id_prompts_fan_out_one_request_each(gw):
    resp = await complete(gw, prompt=[[1, 2], [3]], max_tokens=2)
    assert resp.status_code == 200, resp.text
    assert sorted(c.req.prompt_token_ids for c in gw.calls) == [(1, 2), (3,)]
    assert [c["index"] for c in resp.json()["choices"]] == [0, 1]
