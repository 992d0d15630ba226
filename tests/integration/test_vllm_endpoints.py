"""vLLM's small endpoints: GET /health, GET /version, POST /tokenize, POST /detokenize (shapes, auth, errors)."""

from __future__ import annotations

import pytest

from gateway.settings import VERSION
from tests.integration.conftest import MODEL, SIE_MODEL, assert_error


async def test_health_is_200_while_a_model_is_served_and_open_without_auth(make_gateway):
    gw = await make_gateway(auth_mode="token", auth_tokens=("t",))
    resp = await gw.client.get("/health")
    assert resp.status_code == 200  # all a vLLM-style client reads; the body is the contract's (test_gateway_health)
    assert resp.headers["content-type"].startswith("application/json") and resp.json()["status"] == "healthy"
    assert (await gw.client.get("/version")).json() == {"version": VERSION}


async def test_tokenize_prompt_and_token_strs(gw):
    resp = await gw.client.post("/tokenize", json={"model": SIE_MODEL, "prompt": "a b c", "return_token_strs": True})
    assert resp.status_code == 200, resp.text
    assert resp.json() == {"count": 3, "max_model_len": 2048, "tokens": [0, 1, 2], "token_strs": ["a", "b", "c"]}
    (task,) = gw.fake().tokenizer_calls
    assert task.prompt == "a b c" and task.options == {"add_special_tokens": True, "return_token_strs": True}


async def test_tokenize_messages_defaults_as_vllm(gw):
    resp = await gw.client.post("/tokenize", json={"model": MODEL, "messages": [{"role": "user", "content": "x y"}]})
    assert resp.json() == {"count": 2, "max_model_len": 2048, "tokens": [0, 1], "token_strs": None}
    (task,) = gw.fake().tokenizer_calls
    assert task.messages == ({"role": "user", "content": "x y"},)
    assert task.options == {"add_special_tokens": False, "return_token_strs": False, "add_generation_prompt": True,
                            "continue_final_message": False}


async def test_detokenize(gw):
    resp = await gw.client.post("/detokenize", json={"model": MODEL, "tokens": [5, 6]})
    assert resp.status_code == 200 and resp.json() == {"prompt": "t5 t6"}


@pytest.mark.parametrize(("path", "body", "status", "code", "param"), [
    ("/tokenize", {"model": MODEL}, 400, "invalid_request", "prompt"),
    ("/tokenize", {"model": MODEL, "prompt": "a", "messages": [{"role": "user", "content": "b"}]}, 400,
     "invalid_request", "messages"),
    ("/tokenize", {"model": MODEL, "prompt": "a", "add_generation_prompt": True}, 400, "invalid_request",
     "add_generation_prompt"),
    ("/tokenize", {"model": MODEL, "prompt": "a", "truncate_prompt_tokens": 3}, 400, "unsupported_field",
     "truncate_prompt_tokens"),
    ("/tokenize", {"model": "no/such", "prompt": "a"}, 404, "model_not_found", "model"),
    ("/detokenize", {"model": MODEL, "tokens": [-1]}, 400, "invalid_request", "tokens[0]"),
    ("/detokenize", {"model": MODEL, "tokens": "1 2"}, 400, "invalid_request", "tokens"),
])
async def test_errors_name_the_field(gw, path, body, status, code, param):
    assert_error(await gw.client.post(path, json=body), status, code, param)


async def test_tokenize_needs_auth_like_inference(make_gateway):
    gw = await make_gateway(auth_mode="token", auth_tokens=("t",))
    assert_error(await gw.client.post("/tokenize", json={"model": MODEL, "prompt": "a"}), 401, "UNAUTHORIZED")
    ok = await gw.client.post("/tokenize", json={"model": MODEL, "prompt": "a"}, headers={"Authorization": "Bearer t"})
    assert ok.status_code == 200


async def test_tokenize_with_triton_down_is_503(gw):
    gw.fake().down = True
    resp = await gw.client.post("/tokenize", json={"model": MODEL, "prompt": "a"})
    assert resp.status_code == 503 and resp.json()["error"]["code"] in ("transport_failure", "PROVISIONING")
