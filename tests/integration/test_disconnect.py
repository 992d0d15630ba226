"""A client that goes away cancels its Triton request (CONVENTIONS habit 4), streaming or blocking."""

from __future__ import annotations

import asyncio

import pytest

from tests.integration.conftest import HANG, MODEL, SIE_MODEL, Delay, ev, raw_call

CHAT = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}]}
GENERATE = {"prompt": "Once upon", "max_new_tokens": 64}


def endless(req):
    """A model that keeps producing a token every 20 ms for far longer than any test."""
    return [ev("tok", prompt=1)] + [Delay(0.02), ev("tok", prompt=1)] * 10_000


async def run_until_disconnected(task) -> None:
    """The app returns promptly and cleanly once the client has gone (an escaping exception, even a
    CancelledError, is logged by uvicorn as "Exception in ASGI application")."""
    done, _ = await asyncio.wait({task}, timeout=2)
    assert task in done, "the app kept running after the client disconnected"
    assert not task.cancelled()
    if task.exception() is not None:
        raise task.exception()


@pytest.mark.parametrize(("path", "body"), [("/v1/chat/completions", CHAT), (f"/v1/generate/{SIE_MODEL}", GENERATE)])
@pytest.mark.parametrize("script", [endless, [ev("first", prompt=1), HANG]], ids=["producing", "silent"])
async def test_stream_disconnect_cancels_upstream(gw, path, body, script):
    gw.fake().script = script
    exchange, run = raw_call(gw.app, path, {**body, "stream": True})
    task = asyncio.ensure_future(run())
    await asyncio.wait_for(exchange.first_body.wait(), 2)
    assert exchange.status == 200
    assert exchange.headers["content-type"].startswith("text/event-stream")
    exchange.disconnect.set()
    await run_until_disconnected(task)
    (call,) = gw.calls
    assert call.cancelled and call.closed and not call.completed
    assert b"[DONE]" not in b"".join(exchange.chunks)  # nobody is listening any more
    assert gw.registry.endpoints[0].outstanding == 0


@pytest.mark.parametrize(("path", "body"), [("/v1/chat/completions", CHAT), (f"/v1/generate/{SIE_MODEL}", GENERATE)])
@pytest.mark.parametrize("script", [endless, [ev("first", prompt=1), HANG]], ids=["producing", "silent"])
async def test_blocking_disconnect_cancels_upstream(gw, path, body, script):
    gw.fake().script = script
    exchange, run = raw_call(gw.app, path, body)
    task = asyncio.ensure_future(run())
    await asyncio.wait_for(gw_first_call(gw), 2)
    await asyncio.sleep(0.05)
    exchange.disconnect.set()
    await run_until_disconnected(task)
    (call,) = gw.calls
    assert call.cancelled and call.closed and not call.completed
    assert gw.registry.endpoints[0].outstanding == 0


async def gw_first_call(gw) -> None:
    while not gw.calls:
        await asyncio.sleep(0.005)
    await gw.calls[0].first_sent.wait()


async def test_completed_stream_is_not_reported_cancelled(gw):
    exchange, run = raw_call(gw.app, "/v1/chat/completions", {**CHAT, "stream": True})
    await asyncio.wait_for(run(), 2)
    (call,) = gw.calls
    assert call.completed and call.closed and not call.cancelled
    assert b"".join(exchange.chunks).endswith(b"data: [DONE]\n\n")


QUEUED_PATHS = [("/v1/chat/completions", CHAT), (f"/v1/generate/{SIE_MODEL}", GENERATE),
                ("/v1/completions", {"model": MODEL, "prompt": "Once upon", "max_tokens": 8}),
                ("/v1/responses", {"model": MODEL, "input": "hi", "store": False})]


@pytest.mark.parametrize(("path", "body"), QUEUED_PATHS)
@pytest.mark.parametrize("stream", [False, True], ids=["blocking", "streaming"])
async def test_a_client_that_leaves_before_its_first_token_cancels_the_queued_request(gw, path, body, stream):
    """The model says nothing yet (the request waits in the engine's queue): the gateway still notices the client
    leave and cancels, instead of holding the request until the first-chunk timeout."""
    gw.fake().script = [HANG]
    exchange, run = raw_call(gw.app, path, {**body, "stream": stream})
    task = asyncio.ensure_future(run())
    while not gw.calls:
        await asyncio.sleep(0.005)
    await asyncio.sleep(0.05)
    exchange.disconnect.set()
    await run_until_disconnected(task)
    (call,) = gw.calls
    assert call.cancelled and call.closed and not call.completed
    assert exchange.status in (None, 499)  # never a stream opened for a client that left
    assert gw.registry.endpoints[0].outstanding == 0
