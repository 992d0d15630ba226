"""vLLM's small endpoints on the real stack: /health, /version, and /tokenize, /detokenize through Triton
with the model's own tokenizer (the counts agree with what generation reports as prompt tokens); and
/v1/responses image input, which only the vision model takes."""

from __future__ import annotations

import httpx

from tests.e2e.conftest import MODEL, SIE_MODEL

PROMPT = "The capital of France is"
MESSAGES = [{"role": "user", "content": "What is the capital of France?"}]


def test_health_and_version(stack):
    health = httpx.get(stack.base_url + "/health", timeout=10)
    assert health.status_code == 200  # all GuideLLM reads; the body is the contract's gateway health
    body = health.json()
    assert body["type"] == "gateway" and body["status"] in ("healthy", "degraded")
    assert MODEL in [m["id"] for m in body["models"] if m["status"] == "serving"]
    assert body["cluster"]["models_loaded"] >= 1 and all(w["healthy"] for w in body["workers"])
    assert httpx.get(stack.base_url + "/version", timeout=10).json()["version"]


def test_tokenize_counts_match_generation_usage(stack, openai_client):
    tokenized = httpx.post(stack.base_url + "/tokenize", json={"model": SIE_MODEL, "prompt": PROMPT,
                                                                "return_token_strs": True}, timeout=30).json()
    completion = openai_client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=1)
    assert tokenized["count"] == len(tokenized["tokens"]) == completion.usage.prompt_tokens
    assert len(tokenized["token_strs"]) == tokenized["count"] and tokenized["max_model_len"] > 0
    chat = httpx.post(stack.base_url + "/tokenize", json={"model": MODEL, "messages": MESSAGES}, timeout=30).json()
    reply = openai_client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=1)
    assert chat["count"] == reply.usage.prompt_tokens and chat["token_strs"] is None


def test_detokenize_round_trip_and_unknown_id(stack):
    ids = httpx.post(stack.base_url + "/tokenize", json={"model": MODEL, "prompt": PROMPT}, timeout=30).json()
    text = httpx.post(stack.base_url + "/detokenize", json={"model": MODEL, "tokens": ids["tokens"]}, timeout=30)
    assert text.json() == {"prompt": PROMPT}
    bad = httpx.post(stack.base_url + "/detokenize", json={"model": MODEL, "tokens": [1, 10_000_000]}, timeout=30)
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "tokens[1]"


def test_responses_input_image_on_the_vision_model_only(stack):
    from tests.e2e.test_images import VLM, data_uri, png

    content = [{"type": "input_text", "text": "What is in this picture?"},
               {"type": "input_image", "image_url": data_uri(png((255, 0, 0)))}]
    body = {"input": [{"role": "user", "content": content}], "max_output_tokens": 8}
    ok = httpx.post(stack.base_url + "/v1/responses", json={"model": VLM, **body}, timeout=120)
    assert ok.status_code == 200, ok.text
    assert ok.json()["usage"]["input_tokens"] > 0 and ok.json()["output"][0]["type"] == "message"
    refused = httpx.post(stack.base_url + "/v1/responses", json={"model": MODEL, **body}, timeout=30)
    assert refused.status_code == 400, refused.text
    assert refused.json()["error"]["param"] == "input[0].content[1].type"
