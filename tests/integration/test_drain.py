"""The worker's drain (SIGTERM): readiness fails at once; generations still open at the deadline end in-band
with `server_shutting_down` and `[DONE]` (streams) or a 503 (blocking), instead of being cut by the SIGKILL."""

from __future__ import annotations

import asyncio

import httpx
import pytest

from gateway.app import create_app
from gateway.disconnect import DisconnectAware
from gateway.drain import Drain, deadline_for
from gateway.metrics import render_metrics
from gateway.registry import ModelRegistry
from gateway.settings import Settings
from tests.helpers.prometheus import metric_value
from tests.helpers.sse import DONE, data_events, parse_sse
from tests.integration.conftest import HANG, MODEL, SIE_MODEL, Delay, FakeTriton, assert_error, one_pool, tokens

GRACEFUL_S = 0.4  # deadline 0.3 s after SIGTERM


@pytest.fixture
async def drained():
    fake = FakeTriton("a")
    settings = Settings(pools=(one_pool(),))
    registry = ModelRegistry(settings, client_factory=lambda url: fake)
    await registry.refresh()
    drain = Drain()
    client = httpx.AsyncClient(transport=httpx.ASGITransport(app=DisconnectAware(
        create_app(settings, registry, drain))), base_url="http://gateway", timeout=10)
    yield fake, drain, client
    await client.aclose()


def slow(*texts: str, every_s: float) -> list:
    return [step for token in tokens(*texts) for step in (Delay(every_s), token)]


def test_the_deadline_leaves_time_to_write_the_ending():
    assert deadline_for(30) == 28 and deadline_for(4) == 3 and deadline_for(0) == 0


async def test_readiness_fails_at_once_when_draining(drained):
    _, drain, client = drained
    assert (await client.get("/readyz")).status_code == 200
    drain.begin(GRACEFUL_S)
    resp = await client.get("/readyz")
    assert resp.status_code == 503 and resp.json()["status"] == "draining"


async def test_a_stream_that_ends_before_the_deadline_finishes_whole(drained):
    fake, drain, client = drained
    fake.script = slow("a", "b", "c", every_s=0.05)
    request = asyncio.create_task(client.post("/v1/chat/completions", json={
        "model": MODEL, "messages": [{"role": "user", "content": "hi"}], "stream": True}))
    await asyncio.sleep(0.06)
    drain.begin(GRACEFUL_S)
    events = data_events(parse_sse((await request).text))
    assert events[-1] == DONE and not any("error" in e for e in events[:-1])
    assert "".join(c["delta"].get("content", "") for e in events[:-1] for c in e["choices"]) == "abc"


@pytest.mark.parametrize("route", ["chat", "generate"])
async def test_a_stream_still_open_at_the_deadline_ends_in_band_with_done(drained, route):
    fake, drain, client = drained
    fake.script = slow(*[f"t{i} " for i in range(100)], every_s=0.05)  # 5 s: far past the deadline
    if route == "chat":
        request = client.post("/v1/chat/completions", json={
            "model": MODEL, "messages": [{"role": "user", "content": "hi"}], "stream": True})
    else:
        request = client.post(f"/v1/generate/{SIE_MODEL}", json={"prompt": "hi", "max_new_tokens": 200, "stream": True})
    task = asyncio.create_task(request)
    counted = metric_value(render_metrics()[0].decode(), "sie_gateway_errors_total", code="server_shutting_down",
                           status="200")
    await asyncio.sleep(0.1)
    drain.begin(GRACEFUL_S)
    started = asyncio.get_running_loop().time()
    resp = await task
    elapsed = asyncio.get_running_loop().time() - started
    events = data_events(parse_sse(resp.text))
    assert resp.status_code == 200 and events[-1] == DONE and events.count(DONE) == 1
    error = events[-2]["error"]
    assert error["code"] == "server_shutting_down" and error["message"]
    if route == "chat":
        assert error["type"] == "server_error" and events[-2]["choices"][0]["finish_reason"] is None
        assert any(c["delta"].get("content") for e in events[:-2] for c in e["choices"])  # it had streamed
    else:
        assert events[-2]["done"] is True and events[-2]["finish_reason"] == "error"
    # ended at the deadline (0.3 s after the drain began), not when the scripted generation would have: fewer
    # than its 100 tokens went out. A token count, not a clock bound, so a slow box cannot fail it.
    assert elapsed > 0.25
    if route == "chat":
        streamed = sum(1 for e in events[:-2] for c in e["choices"] if c["delta"].get("content"))
    else:
        streamed = sum(1 for e in events[:-2] if e.get("text_delta"))
    assert 0 < streamed < 100
    assert fake.calls[0].cancelled  # the Triton request is cancelled, not left generating
    assert metric_value(render_metrics()[0].decode(), "sie_gateway_errors_total", code="server_shutting_down",
                        status="200") == counted + 1  # errors by code, for the dashboard


async def test_a_blocking_request_open_at_the_deadline_is_a_503(drained):
    fake, drain, client = drained
    fake.script = [HANG]  # waiting for its first token
    task = asyncio.create_task(client.post("/v1/chat/completions", json={
        "model": MODEL, "messages": [{"role": "user", "content": "hi"}]}))
    await asyncio.sleep(0.1)
    drain.begin(GRACEFUL_S)
    resp = await task
    assert_error(resp, 503, "server_shutting_down")
    assert resp.headers["retry-after"] == "1"
    # and once the deadline has passed, nothing new starts
    resp = await client.post("/v1/chat/completions", json={
        "model": MODEL, "messages": [{"role": "user", "content": "hi"}], "stream": True})
    assert_error(resp, 503, "server_shutting_down")
    assert len(fake.calls) == 1
