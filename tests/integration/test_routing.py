"""Routing headers and multi-endpoint behaviour (docs/contract.md, "Request headers")."""

from __future__ import annotations

import pytest

from gateway.settings import EndpointConfig, PoolConfig
from gateway.triton.client import UpstreamUnavailable
from tests.integration.conftest import (
    BASE_PARAMS,
    MODEL,
    SIE_MODEL,
    TRITON_MODEL,
    assert_error,
    assert_sie_headers,
    one_pool,
    tokens,
)

LOCAL_AND_REMOTE = (one_pool(EndpointConfig(url="a"), EndpointConfig(url="b", remote=True)),)
TWO_LOCAL = (one_pool(EndpointConfig(url="a"), EndpointConfig(url="b")),)
TWO_POOLS = (
    one_pool(EndpointConfig(url="a")),
    PoolConfig("gpu", "l4", (EndpointConfig(url="c"),)),
)


async def test_same_routing_key_same_endpoint(make_gateway):
    gw = await make_gateway(pools=TWO_LOCAL)
    for key in ("user-1", "user-2", "user-3", "user-4"):
        before = len(gw.calls)
        for _ in range(4):
            assert (await gw.chat(routing_key=key)).status_code == 200
        urls = {url for url, fake in gw.fakes.items() for c in fake.calls if c.req.routing_key == key}
        assert len(urls) == 1, (key, urls)
        assert len(gw.calls) == before + 4
    # prompt_cache_key is an affinity key too
    for _ in range(3):
        await gw.generate(prompt_cache_key="doc-9")
    assert len({url for url, f in gw.fakes.items() for c in f.calls if c.req.prompt_cache_key == "doc-9"}) == 1


async def test_affinity_keys_spread_over_endpoints(make_gateway):
    gw = await make_gateway(pools=TWO_LOCAL)
    for i in range(24):
        await gw.chat(routing_key=f"k{i}")
    assert set(gw.served_by()) == {"a", "b"}


@pytest.mark.parametrize("stream", [False, True])
async def test_failure_before_first_token_is_retried_on_other_endpoint(make_gateway, stream):
    gw = await make_gateway(pools=TWO_LOCAL)
    failures = []

    def flaky_once(req):
        if not failures:
            failures.append(1)
            return [UpstreamUnavailable("connection refused")]
        return tokens("ok")

    for fake in gw.fakes.values():
        fake.script = flaky_once
    resp = await gw.chat(stream=stream)
    assert resp.status_code == 200, resp.text
    assert "ok" in resp.text
    first, second = gw.served_by()
    assert first != second
    # the failed endpoint leaves routing until the next refresh
    assert not next(e for e in gw.registry.endpoints if e.name == first).healthy


async def test_all_endpoints_failing_is_503(make_gateway):
    gw = await make_gateway(pools=TWO_LOCAL)
    for fake in gw.fakes.values():
        fake.script = [UpstreamUnavailable("connection refused")]
    resp = await gw.generate()
    assert_error(resp, 503, "PROVISIONING", None)  # what the next request gets too: no endpoint is reachable
    assert resp.headers["retry-after"] == "60"
    assert len(gw.calls) == 2


async def test_remote_forbid_routes_local_only(make_gateway):
    gw = await make_gateway(pools=LOCAL_AND_REMOTE)
    for i in range(10):
        resp = await gw.chat(routing_key=f"k{i}", headers={"X-SIE-Remote": "forbid"})
        assert resp.status_code == 200
    assert set(gw.served_by()) == {"a"}


async def test_remote_forbid_with_only_remote_endpoints_is_400(make_gateway):
    gw = await make_gateway(pools=(one_pool(EndpointConfig(url="b", remote=True)),))
    resp = await gw.generate(headers={"X-SIE-Remote": "forbid"})
    assert_error(resp, 400, "invalid_request", "X-SIE-Remote")
    assert (await gw.generate()).status_code == 200  # without the header the remote endpoint serves
    assert len(gw.fake("b").calls) == 1  # only the request without the header reached it


async def test_remote_forbid_with_unhealthy_local_is_503_retry_after_5(make_gateway):
    def setup(fakes):
        fakes["a"].down = True

    gw = await make_gateway(pools=LOCAL_AND_REMOTE, setup=setup)
    resp = await gw.chat(headers={"X-SIE-Remote": "forbid"})
    assert_error(resp, 503, "transport_failure", None)
    assert resp.headers["retry-after"] == "5"
    assert (await gw.chat()).status_code == 200


async def test_remote_forbid_with_nothing_reachable_is_still_retry_after_5(make_gateway):
    """docs/contract.md, "Decisions" 15: no healthy local endpoint is 503 with Retry-After 5, also when no endpoint at
    all answers (without the header that is PROVISIONING, with its own Retry-After)."""
    gw = await make_gateway(setup=lambda fakes: setattr(fakes["a"], "down", True))
    forbid = {"X-SIE-Remote": "forbid"}
    for resp in (await gw.chat(headers=forbid), await gw.generate(headers=forbid),
                 await gw.client.post("/v1/completions", json={"model": MODEL, "prompt": "hi", "max_tokens": 2},
                                      headers=forbid),
                 await gw.client.post("/v1/responses", json={"model": MODEL, "input": "hi"}, headers=forbid)):
        assert_error(resp, 503, "transport_failure", None)
        assert resp.headers["retry-after"] == "5"
    provisioning = await gw.chat()
    assert_error(provisioning, 503, "PROVISIONING", None)
    assert provisioning.headers["retry-after"] != "5"


@pytest.mark.parametrize("headers", [
    [("X-SIE-Remote", "allow")],
    [("X-SIE-Remote", "Forbid")],
    [("X-SIE-Remote", "")],
    [("X-SIE-Remote", "forbid, forbid")],
    [("X-SIE-Remote", "forbid"), ("X-SIE-Remote", "forbid")],
])
async def test_remote_header_other_values_are_400(gw, headers):
    resp = await gw.client.post(f"/v1/generate/{SIE_MODEL}", json={"prompt": "x", "max_new_tokens": 1},
                                headers=headers)
    err = assert_error(resp, 400, "invalid_request", "X-SIE-Remote")
    assert err["message"] == "X-SIE-Remote accepts only one value: 'forbid'"
    assert not gw.calls


@pytest.mark.parametrize("pool", ["bad pool", "_default", "_DEFAULT", "x" * 129, "a/b"])
async def test_invalid_pool_is_400(gw, pool):
    resp = await gw.chat(headers={"X-SIE-Pool": pool})
    assert_error(resp, 400, "invalid_request", "pool")


async def test_unknown_pool_is_404(gw):
    resp = await gw.chat(headers={"X-SIE-Pool": "elsewhere"})
    assert_error(resp, 404, "invalid_request", "pool")


async def test_pool_selects_endpoints_case_insensitively(make_gateway):
    gw = await make_gateway(pools=TWO_POOLS)
    for _ in range(5):
        assert (await gw.chat(headers={"X-SIE-Pool": "GPU"})).status_code == 200
    assert set(gw.served_by()) == {"c"}


async def test_machine_profile_selects_pool(make_gateway):
    gw = await make_gateway(pools=TWO_POOLS)
    for header in ("l4", "gpu/l4"):
        assert (await gw.generate(headers={"X-SIE-MACHINE-PROFILE": header})).status_code == 200
    assert (await gw.generate(model=f"{SIE_MODEL}:l4")).status_code == 200
    assert set(gw.served_by()) == {"c"}


async def test_unconfigured_machine_profile_is_503(gw):
    """docs/contract.md, "Capacity and routing errors": 503 GPU_NOT_CONFIGURED. Configuration, not a transport failure:
    no Retry-After, so the SDK does not retry it; and a huge value is named by a short prefix, never echoed back
    whole."""
    resp = await gw.chat(headers={"X-SIE-MACHINE-PROFILE": "h100"})
    err = assert_error(resp, 503, "GPU_NOT_CONFIGURED", "X-SIE-MACHINE-PROFILE", "server_error")
    assert err["message"] == "machine profile 'h100' is not configured on this gateway"
    assert "retry-after" not in resp.headers
    resp = await gw.generate(headers={"X-SIE-MACHINE-PROFILE": "z" * 1_000_000})
    err = assert_error(resp, 503, "GPU_NOT_CONFIGURED", "X-SIE-MACHINE-PROFILE")
    assert len(resp.content) < 1000 and "(1000000 characters)" in err["message"]
    resp = await gw.chat(headers={"X-SIE-MACHINE-PROFILE": "nopool/l4"})
    assert_error(resp, 404, "invalid_request", "pool")


@pytest.mark.parametrize("version", ["0.10.1", "99.0.0", "0.1.0", "not-a-version", ""])
async def test_sdk_version_is_never_rejected(gw, version):
    resp = await gw.generate(headers={"X-SIE-SDK-Version": version})
    assert resp.status_code == 200
    assert_sie_headers(resp)


async def test_a_model_loaded_after_the_last_refresh_is_found_at_once(make_gateway):
    """The registry re-asks Triton before a 404: a just-loaded model (or a fresh worker) never 404s."""
    gw = await make_gateway(setup=lambda fakes: setattr(fakes["a"], "models", []))
    gw.fake().models = [(TRITON_MODEL, "READY", dict(BASE_PARAMS))]  # Triton loaded it since
    gw.registry.refreshed_at = 0.0  # the last background refresh is old
    r = await gw.generate()
    assert r.status_code == 200, r.text
    unknown = await gw.generate(model="acme__Nothing")
    assert unknown.status_code == 404 and unknown.json()["error"]["code"] == "model_not_found"


@pytest.mark.parametrize("field", ["model", "lora_adapter", "unknown_key"])
async def test_errors_quote_only_a_prefix_of_a_huge_value(gw, field):
    huge = "m" * 2_000_000
    if field == "model":
        resp = await gw.chat(model=huge)
        code, param = "model_not_found", "model"
    elif field == "lora_adapter":
        resp = await gw.chat(lora_adapter=huge)
        code, param = "unknown_lora_adapter", "lora_adapter"
    else:
        resp = await gw.client.post(f"/v1/generate/{SIE_MODEL}",
                                    json={"prompt": "x", "max_new_tokens": 1, "options": {huge: 1}})
        code, param = "invalid_request", "options"
    err = assert_error(resp, resp.status_code, code, param)
    assert resp.status_code in (400, 404)
    assert len(resp.content) < 1000 and "(2000000 characters)" in err["message"], err["message"][:200]


@pytest.mark.parametrize("value", ["bogus", "", "Triton", "vllm"])
async def test_an_unknown_engine_pin_is_400_before_any_call(gw, value):
    for resp in (await gw.chat(headers={"X-SIE-Engine": value}),
                 await gw.generate(headers={"X-SIE-Engine": value}),
                 await gw.client.post("/v1/completions", json={"model": MODEL, "prompt": "x"},
                                      headers={"X-SIE-Engine": value})):
        assert_error(resp, 400, "invalid_request", "X-SIE-Engine")
    assert not gw.calls


async def test_the_engine_this_gateway_fronts_may_be_pinned(gw):
    assert (await gw.chat(headers={"X-SIE-Engine": "triton"})).status_code == 200
    assert (await gw.generate(headers={"X-SIE-Engine": "triton"})).status_code == 200


async def test_served_by_is_stamped_on_2xx_and_5xx_never_on_4xx(make_gateway):
    gw = await make_gateway(pools=LOCAL_AND_REMOTE)
    local = await gw.chat(headers={"X-SIE-Remote": "forbid"})
    assert local.status_code == 200 and local.headers["x-sie-served-by"] == "local"
    streamed = await gw.generate(stream=True, headers={"X-SIE-Remote": "forbid"})
    assert streamed.status_code == 200 and streamed.headers["x-sie-served-by"] == "local"
    by = set()
    for i in range(12):  # both endpoints serve: some land on the remote one
        resp = await gw.chat(routing_key=f"k{i}")
        by.add((gw.served_by()[-1], resp.headers["x-sie-served-by"]))
    assert by == {("a", "local"), ("b", "remote")}
    client_error = await gw.chat(max_tokens=-1)
    assert client_error.status_code == 400 and "x-sie-served-by" not in client_error.headers
    gw.fake("a").down = gw.fake("b").down = True
    await gw.registry.refresh()
    unavailable = await gw.chat()
    assert unavailable.status_code == 503 and unavailable.headers["x-sie-served-by"] == "local"
