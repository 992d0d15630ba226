"""Priorities, fair-share tenants and per-key limits through the real app against the fake Triton: `priority` and the
tenant (a keyed hash, with its weight) reach the Triton request; a key's priority range, concurrency and tokens per
minute are enforced with OpenAI's 429 and headers; a slot comes back however its request ends."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from gateway.metrics import RATE_LIMITED
from tests.integration.conftest import HANG, MODEL, SIE_MODEL, assert_error, ev, raw_call, tokens

KEY_A, KEY_B, KEY_C = "tenant-a-key-7f3e9a", "tenant-b-key-51c0d2", "tenant-a-second-key-88e1"
CHAT = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}]}
ROUTES: list[tuple[str, dict[str, Any]]] = [
    ("/v1/chat/completions", CHAT),
    ("/v1/completions", {"model": MODEL, "prompt": "hi"}),
    ("/v1/responses", {"model": MODEL, "input": "hi"}),
    (f"/v1/generate/{SIE_MODEL}", {"prompt": "hi", "max_new_tokens": 4}),
]


def _as(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


async def _keyed(make_gateway, tmp_path, text: str, **settings: Any):
    keys = tmp_path / "keys"
    keys.write_text(text)
    return await make_gateway(auth_mode="token", auth_tokens_file=str(keys), **settings)


@pytest.mark.parametrize(("path", "body"), ROUTES)
async def test_priority_reaches_the_triton_request_on_every_route(gw, path, body):
    resp = await gw.client.post(path, json={**body, "priority": -3})
    assert resp.status_code == 200, resp.text
    (call,) = gw.calls
    assert call.req.priority == -3 and call.req.sampling_parameters()["priority"] == -3


@pytest.mark.parametrize(("path", "body"), ROUTES)
async def test_a_bad_priority_is_a_400_before_anything_runs(gw, path, body):
    assert_error(await gw.client.post(path, json={**body, "priority": 1001}), 400, "invalid_request", "priority")
    assert_error(await gw.client.post(path, json={**body, "priority": "1"}), 400, "invalid_request", "priority")
    assert not gw.calls


@pytest.mark.parametrize("scope", ["tenant", "global"])
async def test_each_tenant_reaches_the_engine_with_its_weight_in_either_cache_scope(make_gateway, tmp_path, scope):
    gw = await _keyed(make_gateway, tmp_path, f"team-a {KEY_A} weight=2\nteam-a {KEY_C} weight=2\n{KEY_B}\n",
                      prefix_cache_scope=scope)
    for key in (KEY_A, KEY_B, KEY_C):
        assert (await gw.chat(headers=_as(key))).status_code == 200
    assert (await gw.generate(headers={"x-api-key": KEY_B})).status_code == 200
    a, b, c, b2 = (call.req for call in gw.calls)
    assert a.tenant and b.tenant and a.tenant != b.tenant
    assert a.tenant == c.tenant and b.tenant == b2.tenant  # one tenant, whatever its key or route
    assert (a.tenant_weight, b.tenant_weight) == (2.0, 1.0)
    assert (a.cache_salt is None) == (scope == "global")  # the salt follows the scope; the tenant does not
    assert all(key not in r.tenant and "team-a" not in r.tenant for r in (a, b) for key in (KEY_A, KEY_B, KEY_C))


async def test_with_auth_off_the_user_names_the_tenant_as_a_keyed_hash(gw):
    for user in ("alice@example.com", "bob@example.com", "alice@example.com", None):
        assert (await gw.chat(**({"user": user} if user else {}))).status_code == 200
    resp = await gw.client.post("/v1/completions", json={"model": MODEL, "prompt": "hi", "user": "bob@example.com"})
    assert resp.status_code == 200
    alice, bob, alice2, nobody, bob2 = (call.req for call in gw.calls)
    assert alice.tenant and bob.tenant and alice.tenant != bob.tenant
    assert alice.tenant == alice2.tenant and bob.tenant == bob2.tenant and nobody.tenant is None
    assert "alice" not in alice.tenant and alice.user is None  # the user itself goes no further than admission


async def test_a_model_without_the_tenant_input_is_sent_none(make_gateway):
    def older_model(fakes):
        fakes["a"].inputs = frozenset({"text_input", "messages", "sampling_parameters", "stream", "cache_salt"})

    gw = await make_gateway(auth_mode="token", auth_tokens=(KEY_A,), setup=older_model)
    assert (await gw.chat(headers=_as(KEY_A))).status_code == 200
    assert gw.calls[0].req.tenant is None  # Triton would refuse an input the model does not declare


async def test_a_key_asks_only_for_the_priorities_it_is_allowed(make_gateway, tmp_path):
    gw = await _keyed(make_gateway, tmp_path, f"team-a {KEY_A} priority=-5..5\n{KEY_B}\n")
    assert (await gw.chat(headers=_as(KEY_A), priority=-5)).status_code == 200
    assert (await gw.chat(headers=_as(KEY_B), priority=7)).status_code == 200  # running later is always allowed
    err = assert_error(await gw.chat(headers=_as(KEY_A), priority=6), 400, "invalid_request", "priority")
    assert "[-5, 5]" in err["message"]
    # a key without a range may not jump the queue
    assert_error(await gw.chat(headers=_as(KEY_B), priority=-1), 400, "invalid_request", "priority")
    assert [call.req.priority for call in gw.calls] == [-5, 7]


async def test_past_the_concurrency_limit_a_429_until_a_slot_frees_whatever_ended_it(make_gateway, tmp_path):
    gw = await _keyed(make_gateway, tmp_path, f"{KEY_A} max_concurrent=1\n{KEY_B}\n")
    gw.fake().script = [ev("first", prompt=1), HANG]
    exchange, run = raw_call(gw.app, "/v1/chat/completions", {**CHAT, "stream": True}, _as(KEY_A))
    task = asyncio.ensure_future(run())
    await asyncio.wait_for(exchange.first_body.wait(), 2)
    resp = await gw.chat(headers=_as(KEY_A))
    err = assert_error(resp, 429, "rate_limit_exceeded", None, type_="requests")
    assert resp.headers["retry-after"] == "1"
    assert resp.headers["x-ratelimit-limit-requests"] == "1"
    assert resp.headers["x-ratelimit-remaining-requests"] == "0"
    assert "1 at once" in err["message"]
    gw.fake().script = tokens("fine")
    assert (await gw.chat(headers=_as(KEY_B))).status_code == 200  # another key is not held back
    exchange.disconnect.set()  # the client leaves: its slot comes back
    await asyncio.wait_for(task, 2)
    for stream in (False, True, False):  # a finished request, blocking or streamed, gives its slot back
        assert (await gw.chat(headers=_as(KEY_A), stream=stream)).status_code == 200
    gw.fake().script = [RuntimeError("engine fault")]
    assert (await gw.chat(headers=_as(KEY_A))).status_code == 500  # so does a failed one
    gw.fake().script = tokens("fine")
    assert (await gw.chat(headers=_as(KEY_A), priority=-1)).status_code == 400  # and a refused one
    assert (await gw.chat(headers=_as(KEY_A))).status_code == 200


async def test_past_the_tokens_per_minute_a_429_with_the_window_s_retry_after(make_gateway, tmp_path):
    gw = await _keyed(make_gateway, tmp_path, f"{KEY_A} tpm=100\n")
    first = await gw.chat(headers=_as(KEY_A), max_tokens=60)  # 60 + 1 for "hi" (4 characters a token)
    assert first.status_code == 200
    assert first.headers["x-ratelimit-limit-tokens"] == "100"
    assert first.headers["x-ratelimit-remaining-tokens"] == "39"
    resp = await gw.chat(headers=_as(KEY_A), max_tokens=60)
    assert_error(resp, 429, "rate_limit_exceeded", None, type_="tokens")
    assert 58 <= int(resp.headers["retry-after"]) <= 60  # the first charge leaves the 60 s window then
    assert resp.headers["x-ratelimit-remaining-tokens"] == "39"
    assert resp.headers["x-ratelimit-reset-tokens"] in ("58s", "59s", "60s", "1m0s")
    assert (await gw.chat(headers=_as(KEY_A), max_tokens=38)).status_code == 200  # what is left still fits
    tenant = gw.calls[0].req.tenant
    assert RATE_LIMITED.labels(tenant=tenant[:12], limit="tokens")._value.get() >= 1
    # a completions request counts every prompt
    resp = await gw.client.post("/v1/completions", json={"model": MODEL, "prompt": ["a", "b"], "max_tokens": 1},
                                headers=_as(KEY_A))
    assert resp.status_code == 429 and "needs about 4" in resp.json()["error"]["message"]
