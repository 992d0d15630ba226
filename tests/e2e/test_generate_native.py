"""/v1/generate/{model} over raw HTTP against the real stack."""

from __future__ import annotations

import json

import httpx

from tests.e2e.conftest import MODEL, SIE_MODEL
from tests.helpers.sse import data_payloads


def test_blocking_generate(stack):
    r = httpx.post(f"{stack.base_url}/v1/generate/{SIE_MODEL}",
                   json={"prompt": "The capital of France is", "max_new_tokens": 8, "temperature": 0}, timeout=60)
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["model"] == MODEL
    assert "Paris" in body["text"]
    assert body["finish_reason"] in ("stop", "length")
    assert body["usage"]["completion_tokens"] > 0
    assert isinstance(body["attempt_id"], str) and body["attempt_id"]
    assert body["ttft_ms"] > 0
    assert r.headers["X-SIE-Request-ID"] and r.headers["X-SIE-Server-Version"]


def test_streaming_generate_with_logprobs(stack):
    body = {"prompt": "The capital of France is", "max_new_tokens": 6, "temperature": 0, "stream": True,
            "logprobs": True, "top_logprobs": 2}
    with httpx.stream("POST", f"{stack.base_url}/v1/generate/{SIE_MODEL}", json=body, timeout=60) as r:
        assert r.status_code == 200
        assert r.headers["content-type"].startswith("text/event-stream")
        assert r.headers["cache-control"] == "no-cache"
        payloads = list(data_payloads(r.iter_lines()))
    assert payloads[-1] == "[DONE]"
    events = [json.loads(p) for p in payloads[:-1]]
    assert [e["seq"] for e in events] == list(range(len(events)))
    assert all(not e["done"] for e in events[:-1]) and events[-1]["done"] is True
    assert events[-1]["finish_reason"] == "length"
    assert events[-1]["usage"]["completion_tokens"] == 6
    logprobs = [lp for e in events[:-1] for lp in e["logprobs"]]
    assert len(logprobs) == 6 and all(len(lp["top_logprobs"]) == 2 for lp in logprobs)


def test_slash_in_path_is_rejected_with_safe_id_hint(stack):
    r = httpx.post(f"{stack.base_url}/v1/generate/HuggingFaceTB%2FSmolLM2-135M-Instruct",
                   json={"prompt": "x", "max_new_tokens": 2}, timeout=30)
    assert r.status_code == 400
    err = r.json()["error"]
    assert err["param"] == "model" and err["code"] == "invalid_request"
    assert SIE_MODEL in err["message"]
    assert r.headers["X-SIE-Error-Code"] == "invalid_request"


def test_over_the_output_cap_is_context_exceeded(stack):
    r = httpx.post(f"{stack.base_url}/v1/generate/{SIE_MODEL}",
                   json={"prompt": "x", "max_new_tokens": 10**6}, timeout=30)
    assert r.status_code == 400
    assert r.json()["error"]["code"] == "context_exceeded"
    assert r.json()["error"]["param"] == "max_new_tokens"


def test_prompt_longer_than_the_context_is_context_exceeded_on_prompt(stack):
    r = httpx.post(f"{stack.base_url}/v1/generate/{SIE_MODEL}",
                   json={"prompt": "word " * 3000, "max_new_tokens": 4}, timeout=60)
    assert r.status_code == 400
    assert r.json()["error"]["code"] == "context_exceeded"
    assert r.json()["error"]["param"] == "prompt"


def test_prompt_plus_explicit_cap_past_the_context_is_context_exceeded(stack):
    # ~1,500 prompt tokens + 1,000 asked for > the 2,048-token context: an error naming the field, not a clamp
    r = httpx.post(f"{stack.base_url}/v1/generate/{SIE_MODEL}",
                   json={"prompt": "word " * 1500, "max_new_tokens": 1000}, timeout=60)
    assert r.status_code == 400, r.text
    assert (r.json()["error"]["code"], r.json()["error"]["param"]) == ("context_exceeded", "max_new_tokens")


def test_chat_explicit_cap_past_the_context_names_max_tokens(stack):
    # about 1,930 of the 2,048 positions: a cap of 1000 runs past the context, and what is left without a cap is short
    body = {"model": MODEL, "messages": [{"role": "user", "content": "word " * 1900}], "max_tokens": 1000}
    r = httpx.post(f"{stack.base_url}/v1/chat/completions", json=body, timeout=60)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == "max_tokens"
    # without a cap, the default is clamped to what the context has left
    del body["max_tokens"]
    body["stop"] = ["."]
    r = httpx.post(f"{stack.base_url}/v1/chat/completions", json=body, timeout=120)
    assert r.status_code == 200, r.text
