"""Per-request native options (timeouts, stop tokens), blocking progress, capacity codes, and the order in which
the native route checks a request (docs/contract.md, "Native generate")."""

from __future__ import annotations

import time

import pytest

from gateway.settings import EndpointConfig, PoolConfig
from tests.integration.conftest import HANG, MODEL, SIE_MODEL, Delay, assert_error, ev, one_pool, tokens

LONG = [ev("", completion=1)] + [Delay(0.05)] * 400 + tokens("late")  # a blocking generation of ~20 s


async def test_overall_timeout_option_cuts_a_long_blocking_generation(gw):
    gw.fake().script = LONG
    resp = await gw.generate(options={"overall_timeout_s": 0.5})
    # a 504 at all is the option at work: the scripted generation (~20 s) ends well inside the 600 s default
    assert_error(resp, 504, "overall_timeout", None, "server_error")
    assert gw.calls[0].cancelled


async def test_timeout_options_are_capped_by_the_operator_maximum(make_gateway):
    gw = await make_gateway(max_timeout_s=0.3)
    gw.fake().script = LONG
    resp = await gw.generate(options={"overall_timeout_s": 1000})
    # uncapped, the 1000 s asked for would let the ~20 s scripted generation finish with a 200
    assert_error(resp, 504, "overall_timeout", None)


async def test_first_chunk_timeout_option_replaces_the_default(gw):
    gw.fake().script = [HANG]
    started = time.monotonic()
    resp = await gw.generate(options={"first_chunk_timeout_s": 0.2})
    assert_error(resp, 504, "first_chunk_timeout", None)
    # without the option the default (120 s) would answer the same 504: half of it is a margin no box misses
    assert time.monotonic() - started < 60


async def test_inter_chunk_timeout_option_applies_to_streams(make_gateway):
    gw = await make_gateway(inter_chunk_timeout_s=0.1)
    gw.fake().script = [ev("a"), Delay(0.3), *tokens("b")]
    resp = await gw.generate(stream=True, options={"inter_chunk_timeout_s": 2})
    assert resp.status_code == 200
    assert '"text_delta":"b"' in resp.text and "inter_chunk_timeout" not in resp.text


async def test_blocking_n2_closures_far_apart_are_not_an_inter_chunk_timeout(make_gateway):
    gw = await make_gateway(inter_chunk_timeout_s=0.1, overall_timeout_s=5)
    gw.fake().script = [ev("", completion=1), ev("one", finish="stop", completion=1), Delay(0.3),
                        ev("two", index=1, finish="stop", completion=1)]
    resp = await gw.chat(n=2)
    assert resp.status_code == 200, resp.text
    assert [c["message"]["content"] for c in resp.json()["choices"]] == ["one", "two"]


async def test_progress_marker_is_not_rendered(gw):
    gw.fake().script = [ev("", completion=1, prompt=5), ev("Hi", finish="stop", completion=1, prompt=5)]
    chat = await gw.chat()
    assert chat.json()["choices"][0]["message"]["content"] == "Hi"
    assert chat.json()["usage"]["completion_tokens"] == 1
    native = await gw.generate()
    assert native.json()["text"] == "Hi"


async def test_stop_tokens_reach_triton_as_stop_token_ids(gw):
    resp = await gw.generate(options={"stop_tokens": [2, "<end>", 7]}, stop=["."])
    assert resp.status_code == 200, resp.text
    params = gw.calls[0].req.sampling_parameters()
    assert params["stop_token_ids"] == [2, 7]
    assert params["stop"] == [".", "<end>"]
    await gw.generate()
    assert "stop_token_ids" not in gw.calls[1].req.sampling_parameters()


# -- capacity codes --------------------------------------------------------------------------------

async def test_no_healthy_endpoint_in_the_pool_is_provisioning(make_gateway):
    gw = await make_gateway(pools=(one_pool(EndpointConfig(url="a")), one_pool(EndpointConfig(url="b"), name="gpu")))
    gw.fake("b").down = True
    await gw.registry.refresh()
    resp = await gw.generate(headers={"X-SIE-Pool": "gpu"})
    assert_error(resp, 503, "PROVISIONING", None, "server_error")
    assert resp.headers["retry-after"] == "60"
    assert resp.headers["x-sie-version"] == resp.headers["x-sie-server-version"]


async def test_provisioning_retry_after_is_an_operator_setting(make_gateway):
    gw = await make_gateway(provisioning_retry_after_s=2, setup=lambda fakes: setattr(fakes["a"], "down", True))
    resp = await gw.generate()
    assert_error(resp, 503, "PROVISIONING", None)
    assert resp.headers["retry-after"] == "2"


async def test_configured_but_empty_pool_is_pool_capacity_unavailable(make_gateway):
    gw = await make_gateway(pools=(one_pool(EndpointConfig(url="a")), PoolConfig("empty", "default", ())))
    for resp in (await gw.generate(headers={"X-SIE-Pool": "empty"}), await gw.chat(headers={"X-SIE-Pool": "empty"})):
        assert resp.status_code == 503, resp.text
        assert resp.json()["error"]["code"] == "transport_failure"
        assert resp.headers["x-sie-error-code"] == "POOL_CAPACITY_UNAVAILABLE"
        assert resp.headers["retry-after"]
    assert not gw.calls


async def test_a_call_that_breaks_in_flight_stays_transport_failure(gw):
    from gateway.triton.client import UpstreamUnavailable

    # after its first event; one refused before any output is the outage's 503 PROVISIONING (test_errors.py)
    gw.fake().script = [ev("a"), UpstreamUnavailable("Triton is unavailable (unavailable)")]
    assert_error(await gw.generate(), 503, "transport_failure", None)


async def test_success_carries_both_version_headers(gw):
    resp = await gw.generate()
    assert resp.headers["x-sie-version"] == resp.headers["x-sie-server-version"] != ""


# -- native check order ------------------------------------------------------------------------------

@pytest.mark.parametrize("body", [b"{not json", b'{"prompt": 5}', b""])
async def test_unknown_model_with_a_bad_body_is_404(gw, body):
    resp = await gw.client.post("/v1/generate/acme__Nope", content=body)
    assert_error(resp, 404, "model_not_found", "model", "model_not_found")


async def test_routing_headers_are_checked_before_the_body(gw):
    resp = await gw.client.post(f"/v1/generate/{SIE_MODEL}", content=b"{not json", headers={"X-SIE-Pool": "bad pool"})
    assert_error(resp, 400, "invalid_request", "pool")
    resp = await gw.client.post(f"/v1/generate/{SIE_MODEL}", content=b"{not json", headers={"X-SIE-Pool": "nowhere"})
    assert_error(resp, 404, "invalid_request", "pool")
    resp = await gw.client.post(f"/v1/generate/{SIE_MODEL}", content=b"{}", headers={"X-SIE-Remote": "allow"})
    assert_error(resp, 400, "invalid_request", "X-SIE-Remote")


async def test_profile_suffix_is_checked_before_the_body(gw):
    resp = await gw.client.post(f"/v1/generate/{SIE_MODEL}:h100", content=b"{not json")
    assert_error(resp, 400, "invalid_request", "profile")


async def test_valid_path_and_headers_then_the_body_is_checked(gw):
    resp = await gw.client.post(f"/v1/generate/{SIE_MODEL}", content=b"{not json")
    assert_error(resp, 400, "invalid_request", None)
    assert (await gw.chat(model=MODEL)).status_code == 200
