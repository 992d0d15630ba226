"""Body limits, malformed bodies, health/readiness, model list, OpenAPI, metrics, response headers."""

from __future__ import annotations

import asyncio
import json
import time

import pytest

from gateway.resources.health import READY_MAX_AGE_S
from gateway.settings import EndpointConfig
from tests.helpers.prometheus import metric_value
from tests.integration.conftest import (
    BASE_PARAMS,
    MAX_OUTPUT,
    MODEL,
    SIE_MODEL,
    TRITON_MODEL,
    assert_error,
    assert_sie_headers,
    one_pool,
    tokens,
)


def big_chat_body(size: int) -> bytes:
    return json.dumps({"model": MODEL, "messages": [{"role": "user", "content": "x" * size}]}).encode()


async def test_chat_body_over_limit_is_413(make_gateway):
    gw = await make_gateway(chat_body_limit=1000)
    resp = await gw.client.post("/v1/chat/completions", content=big_chat_body(2000),
                                headers={"content-type": "application/json"})
    err = assert_error(resp, 413, "invalid_request", None, "invalid_request_error")
    assert err["message"] == "Request body too large (max 1000 bytes)"
    assert (await gw.client.post("/v1/chat/completions", content=big_chat_body(500))).status_code == 200
    assert len(gw.calls) == 1


async def test_body_limit_holds_without_content_length(make_gateway):
    gw = await make_gateway(chat_body_limit=1000)

    async def chunks():
        for _ in range(4):
            yield b" " * 400

    resp = await gw.client.post("/v1/chat/completions", content=chunks())
    assert "content-length" not in resp.request.headers
    assert_error(resp, 413, "invalid_request", None)


async def test_generate_body_limit_is_separate(make_gateway):
    gw = await make_gateway(chat_body_limit=100_000, generate_body_limit=1000)
    resp = await gw.generate(prompt="x" * 2000)
    assert_error(resp, 413, "invalid_request", None)
    assert (await gw.chat(messages=[{"role": "user", "content": "x" * 2000}])).status_code == 200


@pytest.mark.parametrize("raw", [b"{not json", b"", b"   ", b"\xff\xfe", b'{"model": "a",}'])
async def test_invalid_json_is_400(gw, raw):
    for path in ("/v1/chat/completions", f"/v1/generate/{SIE_MODEL}"):
        resp = await gw.client.post(path, content=raw, headers={"content-type": "application/json"})
        assert_error(resp, 400, "invalid_request", None, "invalid_request_error")


@pytest.mark.parametrize("raw", [b"[]", b"42", b'"text"', b"null"])
async def test_non_object_body_is_400(gw, raw):
    for path in ("/v1/chat/completions", f"/v1/generate/{SIE_MODEL}"):
        resp = await gw.client.post(path, content=raw)
        assert_error(resp, 400, "invalid_request", None)


async def test_healthz(gw):
    resp = await gw.client.get("/healthz")
    assert resp.status_code == 200 and resp.json() == {"status": "ok"}
    assert_sie_headers(resp)


async def test_readyz_follows_triton(gw):
    resp = await gw.client.get("/readyz")
    assert resp.status_code == 200
    assert resp.json() == {"status": "ready", "healthy_workers": 1}
    gw.fake().down = True
    await asyncio.sleep(READY_MAX_AGE_S)
    resp = await gw.client.get("/readyz")
    assert resp.status_code == 503
    assert resp.headers["retry-after"] == "60"  # as every 503 PROVISIONING of the same outage
    assert resp.json()["status"] != "ready"
    assert_sie_headers(resp)
    gw.fake().down = False
    await asyncio.sleep(READY_MAX_AGE_S)
    assert (await gw.client.get("/readyz")).status_code == 200


async def test_readyz_probes_share_one_triton_call(gw):
    """/readyz is open to anyone: 64 concurrent probes (and a probe per request after) cost at most one
    Triton refresh a second, not one each (about 1,300 Triton calls a second before)."""
    fake = gw.fake()
    await asyncio.sleep(READY_MAX_AGE_S)  # the fixture's refresh is stale: the next probe refreshes
    before = fake.listed
    answers = await asyncio.gather(*(gw.client.get("/readyz") for _ in range(64)))
    assert [r.status_code for r in answers] == [200] * 64
    for _ in range(20):
        assert (await gw.client.get("/readyz")).status_code == 200
    assert fake.listed - before == 1


async def test_readyz_not_ready_while_only_loading(make_gateway):
    def setup(fakes):
        fakes["a"].models = [("tiny", "LOADING", {})]

    gw = await make_gateway(setup=setup)
    assert (await gw.client.get("/readyz")).status_code == 503


async def test_models_list(gw):
    resp = await gw.client.get("/v1/models")
    assert resp.status_code == 200
    body = resp.json()
    assert body["object"] == "list"
    model, adapter = body["data"]  # each LoRA adapter is listed as a model of its own, as vLLM lists it
    assert adapter == {"id": "sql", "object": "model", "created": model["created"], "owned_by": "sie", "root": "sql",
                       "parent": MODEL}
    assert model["id"] == MODEL and model["object"] == "model"
    assert isinstance(model["created"], int) and model["owned_by"]
    assert model["sie_id"] == SIE_MODEL
    assert model["max_output_tokens"] == MAX_OUTPUT
    assert model["lora_adapters"] == ["sql"]
    assert body["models"] == [model]  # the sie-sdk's list_models() reads `models`: base models only


async def test_a_model_entry_is_also_the_sie_sdks_model_info(make_gateway):
    """`name`, `loaded`, `state`, `inputs`, `outputs`, `max_sequence_length`, `revision`, `capabilities`, `routing`:
    the keys the sie-sdk's ModelInfo declares, beside OpenAI's."""
    def setup(fakes):
        fakes["a"].models = [(TRITON_MODEL, "READY", {**BASE_PARAMS, "context_length": "2048", "image_input": "true"})]

    gw = await make_gateway(setup=setup)
    listed = (await gw.client.get("/v1/models")).json()["models"][0]
    retrieved = (await gw.client.get(f"/v1/models/{SIE_MODEL}")).json()
    assert listed == retrieved
    assert {k: retrieved[k] for k in ("name", "loaded", "state", "last_error", "inputs", "outputs",
                                      "max_sequence_length", "capabilities", "routing")} == {
        "name": MODEL, "loaded": True, "state": "loaded", "last_error": None, "inputs": ["text", "image"],
        "outputs": ["text"], "max_sequence_length": 2048,
        "capabilities": {"streaming": True, "grammar": ["json_schema", "regex"], "tools": True,
                         "lora_adapters": ["sql"]},
        "routing": {"policy": None, "upstream_kind": None}}
    generated = await gw.generate()
    assert retrieved["revision"] == generated.headers["x-sie-model-revision"]


async def test_a_model_served_only_by_remote_endpoints_is_remote_only(make_gateway):
    gw = await make_gateway(pools=(one_pool(EndpointConfig(url="a", remote=True)),))
    (model,) = (await gw.client.get("/v1/models")).json()["models"]
    assert model["routing"] == {"policy": "remote_only", "upstream_kind": None}


async def test_models_list_before_first_refresh(make_gateway):
    gw = await make_gateway(refresh=False)
    body = (await gw.client.get("/v1/models")).json()
    assert [m["id"] for m in body["models"]] == [MODEL]


async def test_openapi_has_both_contracts(gw):
    resp = await gw.client.get("/openapi.json")
    assert resp.status_code == 200
    doc = resp.json()
    assert "/v1/chat/completions" in doc["paths"]
    assert "/v1/generate/{model}" in doc["paths"]
    assert "post" in doc["paths"]["/v1/chat/completions"]
    assert "post" in doc["paths"]["/v1/generate/{model}"]


async def test_openapi_documents_responses_and_the_vllm_endpoints(gw):
    doc = (await gw.client.get("/openapi.json")).json()
    paths = doc["paths"]
    assert paths["/v1/responses"]["post"]["requestBody"]["content"]["application/json"]["schema"] == {
        "$ref": "#/components/schemas/ResponsesRequest"}
    assert {"get", "delete"} <= set(paths["/v1/responses/{response_id}"])
    for route in ("/tokenize", "/detokenize"):
        assert "post" in paths[route]
    assert paths["/health"]["get"]["security"] == [] and paths["/version"]["get"]["security"] == []
    schema = doc["components"]["schemas"]["ResponsesRequest"]
    assert {"input", "instructions", "tools", "text", "store", "previous_response_id"} <= set(schema["properties"])


async def test_metrics_count_requests(gw):
    async def read() -> tuple[float, float, float]:
        resp = await gw.client.get("/metrics")
        assert resp.status_code == 200
        assert resp.headers["content-type"].startswith("text/plain")
        return (metric_value(resp.text, "sie_gateway_requests_total", endpoint="chat", status="200"),
                metric_value(resp.text, "sie_gateway_requests_total", endpoint="generate", status="404"),
                metric_value(resp.text, "sie_gateway_request_latency_seconds_count", endpoint="chat"))

    before = await read()
    await gw.chat()
    await gw.chat()
    await gw.generate(model="acme__Missing")
    after = await read()
    # deltas: the counters are process-wide and earlier tests have already moved them
    assert [b - a for a, b in zip(before, after, strict=True)] == [2, 1, 2]


async def test_sie_headers_on_every_kind_of_response(gw):
    responses = [
        await gw.chat(),
        await gw.chat(stream=True),
        await gw.generate(),
        await gw.generate(model="acme__Missing"),
        await gw.client.post("/v1/chat/completions", content=b"nope"),
        await gw.client.get("/v1/unknown-route"),
        await gw.client.get(f"/v1/generate/{SIE_MODEL}"),
        await gw.client.get("/healthz"),
        await gw.client.get("/metrics"),
    ]
    ids = set()
    for resp in responses:
        assert_sie_headers(resp)
        assert resp.headers["x-sie-server-version"] == "0.10.1"
        ids.add(resp.headers["x-sie-request-id"])
    assert len(ids) == len(responses)  # a fresh id per request


async def test_unknown_route_and_wrong_method_use_envelope(gw):
    assert_error(await gw.client.get("/v1/unknown-route"), 404, "invalid_request", None)
    resp = await gw.client.get(f"/v1/generate/{SIE_MODEL}")
    assert_error(resp, 405, "invalid_request", None)
    resp = await gw.client.get("/v1/chat/completions")
    assert_error(resp, 405, "invalid_request", None)


async def _trickle(body: bytes, pause_s: float, stall_after: int | None = None):
    """The body in 8-byte pieces, `pause_s` apart; with `stall_after`, the sender goes quiet after that many."""
    for i in range(0, len(body), 8):
        if stall_after is not None and i // 8 == stall_after:
            await asyncio.sleep(3600)
        yield body[i:i + 8]
        await asyncio.sleep(pause_s)


@pytest.mark.parametrize("path, body", [
    ("/v1/chat/completions", json.dumps({"model": MODEL, "messages": [{"role": "user", "content": "hi"}]})),
    (f"/v1/generate/{SIE_MODEL}", json.dumps({"prompt": "hi", "max_new_tokens": 4})),
])
async def test_a_stalled_body_is_a_408_and_a_moving_one_is_read(make_gateway, path, body):
    gw = await make_gateway(body_read_timeout_s=0.3)
    gw.fake().script = lambda req: tokens("a", "b")
    resp = await gw.client.post(path, content=_trickle(body.encode(), 0.0, stall_after=2),
                                headers={"content-type": "application/json"})
    err = assert_error(resp, 408, "request_timeout", None, "invalid_request_error")
    # the body stalls for good, so only the read timeout can end the request
    assert err["message"] == "request body stalled: no data for 0.3 s"
    assert gw.fake().calls == []  # nothing reached the model
    # slower in total than the timeout, but each piece arrives within it
    started = time.monotonic()
    resp = await gw.client.post(path, content=_trickle(body.encode(), 0.1),
                                headers={"content-type": "application/json"})
    assert resp.status_code == 200, resp.text
    assert time.monotonic() - started > 0.3
