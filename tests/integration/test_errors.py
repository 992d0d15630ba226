"""Path rules, model resolution, capacity and worker errors, timeouts (docs/contract.md, "Native generate", "Capacity
and routing errors")."""

from __future__ import annotations

import base64

import pytest

from gateway.errors import MalformedWorkerResponse, worker_error
from gateway.settings import EndpointConfig
from gateway.triton.client import UpstreamUnavailable
from tests.integration.conftest import (
    BASE_PARAMS,
    HANG,
    MODEL,
    SIE_MODEL,
    TRITON_MODEL,
    Delay,
    assert_error,
    ev,
    one_pool,
    tokens,
)

# -- generate path -----------------------------------------------------------------------------

@pytest.mark.parametrize("path", ["/v1/generate/acme/Tiny-1.5B-Instruct", "/v1/generate/acme%2FTiny-1.5B-Instruct",
                                  "/v1/generate/acme%2fTiny-1.5B-Instruct"])
async def test_slash_in_path_names_the_safe_form(gw, path):
    resp = await gw.client.post(path, json={"prompt": "x", "max_new_tokens": 1})
    err = assert_error(resp, 400, "invalid_request", "model", "invalid_request_error")
    assert "acme__Tiny-1.5B-Instruct" in err["message"]
    assert not gw.calls


async def test_empty_model_path(gw):
    resp = await gw.client.post("/v1/generate/", json={"prompt": "x", "max_new_tokens": 1})
    err = assert_error(resp, 400, "invalid_request", "model")
    assert "empty" in err["message"]


async def test_path_checked_before_body(gw):
    resp = await gw.client.post("/v1/generate/a%2Fb", content=b"{not json")
    assert_error(resp, 400, "invalid_request", "model")


@pytest.mark.parametrize("model", [SIE_MODEL, "acme__Tiny-1_dot_5B-Instruct", TRITON_MODEL,
                                   f"{SIE_MODEL}:default"])
async def test_accepted_model_spellings(gw, model):
    resp = await gw.generate(model=model)
    assert resp.status_code == 200, resp.text
    assert resp.json()["model"] == MODEL


async def test_chat_accepts_canonical_safe_and_profile_suffix(gw):
    for model in (MODEL, SIE_MODEL, f"{MODEL}:default"):
        resp = await gw.chat(model=model)
        assert resp.status_code == 200, (model, resp.text)
        assert resp.json()["model"] == MODEL


async def test_unknown_model_is_404(gw):
    resp = await gw.generate(model="acme__Nope")
    err = assert_error(resp, 404, "model_not_found", "model", "model_not_found")
    assert err["message"] == "Model 'acme/Nope' not found"  # the canonical id, whatever form was sent
    resp = await gw.chat(model="acme/Nope")
    assert_error(resp, 404, "model_not_found", "model", "model_not_found")
    assert not gw.calls


@pytest.mark.parametrize("route", ["chat", "generate"])
async def test_unconfigured_profile_suffix_is_400_naming_profile(gw, route):
    resp = await (gw.chat(model=f"{MODEL}:h100") if route == "chat" else gw.generate(model=f"{SIE_MODEL}:h100"))
    err = assert_error(resp, 400, "invalid_request", "profile", "invalid_request_error")
    assert "h100" in err["message"]
    assert not gw.calls


async def test_configured_profile_suffix_routes_to_its_pool(make_gateway):
    gw = await make_gateway(pools=(one_pool(EndpointConfig(url="a")),
                                   one_pool(EndpointConfig(url="b"), name="gpu", machine_profile="l4")))
    for _ in range(3):
        assert (await gw.generate(model=f"{SIE_MODEL}:l4")).status_code == 200
    assert gw.served_by() == ["b"] * 3


# -- discovery: loading, Triton down --------------------------------------------------------------

async def test_loading_model_is_503_model_loading(make_gateway):
    def setup(fakes):
        # the model is still loading: Triton knows its name but has no config for it yet
        fakes["a"].models = [("tiny_1_5b_instruct", "LOADING", {}), ("other", "READY", {"served_name": "x/other"})]

    gw = await make_gateway(setup=setup)
    for resp in (await gw.generate(model="tiny_1_5b_instruct"), await gw.generate(model=SIE_MODEL),
                 await gw.chat(model=MODEL)):
        assert_error(resp, 503, "MODEL_LOADING", None, "server_error")
        assert resp.headers["retry-after"] == "5"
    # once it is ready, it serves
    gw.fake().models = [("tiny_1_5b_instruct", "READY", dict(BASE_PARAMS))]
    await gw.registry.refresh()
    assert (await gw.chat()).status_code == 200


async def test_a_model_whose_triton_name_says_nothing_is_503_while_it_loads(make_gateway):
    """`tiny_vlm` serves `sie-test/tiny-llava`: no loose match. While a model Triton has never served loads, an
    unknown id is answered retryable (the SDK retries MODEL_LOADING); once every load has ended it is 404."""
    def setup(fakes):
        fakes["a"].models = [("served_model", "READY", dict(BASE_PARAMS)), ("tiny_vlm", "LOADING", {})]

    gw = await make_gateway(setup=setup)
    resp = await gw.generate(model="sie-test__tiny-llava")
    err = assert_error(resp, 503, "MODEL_LOADING", None, "server_error")
    assert resp.headers["retry-after"] == "5" and "sie-test/tiny-llava" in err["message"]
    assert (await gw.generate()).status_code == 200  # what is served meanwhile is served
    gw.fake().models = [("served_model", "READY", dict(BASE_PARAMS)),
                        ("tiny_vlm", "READY", {"served_name": "sie-test/tiny-llava"})]
    await gw.registry.refresh()
    assert (await gw.generate(model="sie-test__nope")).status_code == 404  # nothing loading: unknown is unknown


async def test_a_model_reloading_is_known_by_the_id_it_was_served_with(make_gateway):
    def setup(fakes):
        fakes["a"].models = [("served_model", "READY", dict(BASE_PARAMS)),
                             ("tiny_vlm", "READY", {"served_name": "sie-test/tiny-llava"})]

    gw = await make_gateway(setup=setup)
    gw.fake().models = [("served_model", "READY", dict(BASE_PARAMS)), ("tiny_vlm", "UNAVAILABLE", {})]
    await gw.registry.refresh()
    resp = await gw.generate(model="sie-test__tiny-llava")  # unloaded, not loading: still its id, still retryable
    assert_error(resp, 503, "MODEL_LOADING", None, "server_error")
    assert (await gw.generate(model="sie-test__nope")).status_code == 404  # no load under way: 404 at once


async def test_triton_down_is_503_provisioning(make_gateway):
    def setup(fakes):
        fakes["a"].down = True

    gw = await make_gateway(setup=setup)
    for resp in (await gw.chat(), await gw.generate(), await gw.chat(stream=True)):
        # no reachable endpoint: capacity may come back, the SDK waits for it (docs/contract.md, "Capacity and routing
        # errors")
        assert_error(resp, 503, "PROVISIONING", None, "server_error")
        assert resp.headers["retry-after"] == "60"
    gw.fake().down = False
    await gw.registry.refresh()
    assert (await gw.chat()).status_code == 200


async def test_unreachable_triton_during_request_is_503(gw):
    gw.fake().script = [UpstreamUnavailable("Triton is unavailable (unavailable)")]
    resp = await gw.generate()
    assert_error(resp, 503, "PROVISIONING", None)
    assert resp.headers["retry-after"] == "60"


async def test_one_triton_outage_gives_one_code_and_one_retry_after(gw):
    """The request that meets the outage first, the ones after it (the endpoint is then unhealthy), a blocking
    request cut after its first token, and /readyz: one Retry-After (it said 5, then 5, then 60)."""
    gw.fake().script = [ev("a"), UpstreamUnavailable("Triton is unavailable (unavailable)")]
    cut = await gw.generate()
    assert_error(cut, 503, "transport_failure", None)  # a call broken in flight
    gw.fake().down = True
    gw.fake().script = [UpstreamUnavailable("Triton is unavailable (unavailable)")]
    answers = [await gw.chat(), await gw.generate(), await gw.chat(stream=True), await gw.generate()]
    for resp in answers:
        assert_error(resp, 503, "PROVISIONING", None)
    ready = await gw.client.get("/readyz")
    assert ready.status_code == 503
    assert {r.headers["retry-after"] for r in [cut, *answers, ready]} == {"60"}


# -- worker errors before the first event ---------------------------------------------------------

@pytest.mark.parametrize(
    ("code", "status", "type_", "retry_after"),
    [
        ("QUEUE_FULL", 503, "server_error", "1"),
        ("RESOURCE_EXHAUSTED", 503, "server_error", "5"),
        ("context_exceeded", 400, "context_length_exceeded", None),
        ("invalid_request", 400, "invalid_request_error", None),
        ("rate_limit_exceeded", 429, "rate_limit_error", "1"),
        ("cancelled", 408, "server_error", None),
    ],
)
@pytest.mark.parametrize("route", ["chat", "generate"])
async def test_worker_error_status(gw, code, status, type_, retry_after, route):
    gw.fake().script = [worker_error(code, "worker said no", param="prompt" if status == 400 else None)]
    resp = await (gw.chat() if route == "chat" else gw.generate())
    err = assert_error(resp, status, code, "prompt" if status == 400 else None, type_)
    assert err["message"] == "worker said no"
    assert resp.headers.get("retry-after") == retry_after
    assert gw.calls[0].closed


async def test_unknown_worker_code_is_500_inference_error(gw):
    gw.fake().script = [worker_error("kaboom", "engine crashed")]
    assert_error(await gw.generate(), 500, "inference_error", None, "server_error")


async def test_worker_error_after_tokens_on_blocking_request(gw):
    gw.fake().script = [ev("a"), worker_error("QUEUE_FULL", "late")]
    resp = await gw.chat()
    assert_error(resp, 503, "QUEUE_FULL", None)


SCHEMA = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}


@pytest.mark.parametrize(("route", "field"), [("chat", "response_format"), ("responses", "text.format")])
@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize(("code", "status", "after_tokens"), [("grammar_invalid", 400, False),
                                                              ("MODEL_OUTPUT_PARSE_ERROR", 500, True)])
async def test_a_grammar_error_names_the_clients_field_not_the_engines(gw, route, field, stream, code, status,
                                                                        after_tokens):
    """The engine reports grammar errors against `grammar`; the client sent `response_format` or `text.format`."""
    gw.fake().script = [*([ev("{")] if after_tokens else []), worker_error(code, "bad", param="grammar")]
    if route == "chat":
        resp = await gw.chat(stream=stream, response_format={
            "type": "json_schema", "json_schema": {"name": "x", "strict": True, "schema": SCHEMA}})
    else:
        resp = await gw.client.post("/v1/responses", json={
            "model": MODEL, "input": "hi", "stream": stream,
            "text": {"format": {"type": "json_schema", "name": "x", "strict": True, "schema": SCHEMA}}})
    if not (stream and after_tokens):
        assert_error(resp, status, code, field)
        return
    assert resp.status_code == 200  # the stream had opened: the error is in-band
    assert f'"param":"{field}"' in resp.text and '"param":"grammar"' not in resp.text


PNG = base64.b64encode(b"\x89PNG\r\n\x1a\n" + b"\x00" * 8).decode()  # passes the gateway's checks; the engine decodes


@pytest.mark.parametrize(("route", "field"), [("chat", "messages[0].content[2].image_url"),
                                              ("responses", "input[0].content[2].image_url"),
                                              ("generate", "images[1].data")])
async def test_an_image_the_engine_cannot_decode_is_named_by_its_place_in_the_request(make_gateway, route, field):
    def setup(fakes):
        fakes["a"].models = [(TRITON_MODEL, "READY", {**BASE_PARAMS, "image_input": "true"})]

    gw = await make_gateway(setup=setup)
    gw.fake().script = [worker_error("invalid_request", "image 1 is not an image this model can decode",
                                     param="images[1]")]
    uri = f"data:image/png;base64,{PNG}"
    if route == "chat":
        resp = await gw.chat(messages=[{"role": "user", "content": [
            {"type": "image_url", "image_url": {"url": uri}}, {"type": "text", "text": "and"},
            {"type": "image_url", "image_url": uri}]}])
    elif route == "responses":
        resp = await gw.client.post("/v1/responses", json={"model": MODEL, "input": [{"role": "user", "content": [
            {"type": "input_image", "image_url": uri}, {"type": "input_text", "text": "and"},
            {"type": "input_image", "image_url": uri}]}]})
    else:
        resp = await gw.generate(images=[{"data": PNG}, {"data": PNG}])
    assert_error(resp, 400, "invalid_request", field)


async def test_max_tokens_over_model_cap_is_context_exceeded_before_dispatch(gw):
    resp = await gw.chat(max_tokens=5000)
    assert_error(resp, 400, "context_exceeded", "max_tokens", "context_length_exceeded")
    resp = await gw.generate(max_new_tokens=5000)
    assert_error(resp, 400, "context_exceeded", "max_new_tokens")
    assert not gw.calls


async def test_unknown_lora_adapter_before_dispatch(gw):
    resp = await gw.chat(lora_adapter="nope")
    assert_error(resp, 400, "unknown_lora_adapter", "lora_adapter", "invalid_request_error")
    assert (await gw.chat(lora_adapter="sql")).status_code == 200


async def test_validation_error_names_field(gw):
    resp = await gw.generate(max_new_tokens=0)
    assert_error(resp, 400, "invalid_request", "max_new_tokens")
    resp = await gw.chat(functions=[])
    assert_error(resp, 400, "unsupported_field", "functions")
    assert not gw.calls


# -- malformed worker responses -------------------------------------------------------------------

@pytest.mark.parametrize("route", ["chat", "generate"])
async def test_malformed_worker_response_is_500(gw, route):
    gw.fake().script = [MalformedWorkerResponse("model response violates the tensor contract")]
    resp = await (gw.chat() if route == "chat" else gw.generate())
    assert_error(resp, 500, "malformed_worker_response", None, "server_error")


@pytest.mark.parametrize("route", ["chat", "generate"])
async def test_stream_without_terminal_is_malformed(gw, route):
    gw.fake().script = [ev("a", prompt=1), ev("b", prompt=1)]  # the model never closes the choice
    resp = await (gw.chat() if route == "chat" else gw.generate())
    assert_error(resp, 500, "malformed_worker_response", None, "server_error")


# -- timeouts -------------------------------------------------------------------------------------

@pytest.mark.parametrize("stream", [False, True])
async def test_first_chunk_timeout_is_504(make_gateway, stream):
    gw = await make_gateway(first_chunk_timeout_s=0.1)
    gw.fake().script = [HANG]
    resp = await gw.chat(stream=stream)
    assert_error(resp, 504, "first_chunk_timeout", None, "server_error")
    (call,) = gw.calls
    assert call.cancelled and call.closed


async def test_inter_chunk_timeout_does_not_cut_a_blocking_request(make_gateway):
    # a blocking request hears from the engine at its first token and when choices close: the
    # streaming inter-chunk timeout must not measure the generation between them
    gw = await make_gateway(inter_chunk_timeout_s=0.1, overall_timeout_s=5)
    gw.fake().script = [ev("", completion=1), Delay(0.3), ev("ab", finish="stop", completion=2)]
    resp = await gw.generate()
    assert resp.status_code == 200, resp.text
    assert resp.json()["text"] == "ab"


async def test_a_blocking_request_that_asks_for_an_inter_chunk_bound_gets_it(gw):
    """`options.inter_chunk_timeout_s` on a blocking request: generated as a stream, collected, and 502
    `inter_chunk_timeout` when the chunks stop coming (docs/contract.md, "Errors")."""
    gw.fake().script = [ev("a"), Delay(0.3), ev("b"), *tokens("end")]
    resp = await gw.generate(options={"inter_chunk_timeout_s": 0.1})
    assert_error(resp, 502, "inter_chunk_timeout", None)
    assert gw.calls[0].req.stream is True and gw.calls[0].cancelled
    gw.fake().script = [ev("a"), Delay(0.05), ev("b"), ev("", finish="stop", prompt=3, completion=2)]
    resp = await gw.generate(options={"inter_chunk_timeout_s": 1.0})  # in time: one buffered body, as ever
    assert resp.status_code == 200 and resp.json()["text"] == "ab" and resp.json()["usage"]["completion_tokens"] == 2
    await gw.generate()
    assert gw.calls[-1].req.stream is False  # without the option, blocking stays blocking on the wire


async def test_overall_timeout_is_504(make_gateway):
    gw = await make_gateway(overall_timeout_s=0.3, inter_chunk_timeout_s=5)
    gw.fake().script = [ev("a")] + [Delay(0.05), ev("b")] * 40 + tokens("end")
    resp = await gw.generate()
    assert_error(resp, 504, "overall_timeout", None)
    assert gw.calls[0].cancelled


async def test_slow_but_steady_model_is_not_timed_out(make_gateway):
    gw = await make_gateway(first_chunk_timeout_s=0.3, inter_chunk_timeout_s=0.3)
    gw.fake().script = [Delay(0.1), ev("a"), Delay(0.1), ev("b"), Delay(0.1), ev("c", finish="stop", completion=3)]
    resp = await gw.generate()
    assert resp.status_code == 200 and resp.json()["text"] == "abc"
