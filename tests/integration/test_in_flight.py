"""An endpoint's in-flight count (least-loaded routing, closing a retired endpoint) is taken once per request and given
back once, whatever ends it: each failure before the first token, each failure after it, a timeout, a client that
leaves, a fail-over to another endpoint, and a stream handed to its session and released when it ends."""

from __future__ import annotations

import asyncio

import pytest

from gateway.endpoint import InFlight
from gateway.errors import ModelProcessDied, worker_error
from gateway.settings import EndpointConfig
from gateway.triton.client import UpstreamUnavailable
from tests.integration.conftest import HANG, MODEL, ev, one_pool, raw_call


def _counts(gw) -> list[int]:
    return [e.outstanding for e in gw.registry.endpoints]


def _unreachable() -> UpstreamUnavailable:
    return UpstreamUnavailable("Triton is unavailable (unavailable)")


BEFORE_FIRST = {
    "unreachable": lambda: [_unreachable()],
    "process died": lambda: [ModelProcessDied("the model process of 'tiny' died")],
    "empty stream": lambda: [],
    "worker error": lambda: [worker_error("inference_error", "boom")],
    "upstream cancelled": lambda: [asyncio.CancelledError()],
    "first-chunk timeout": lambda: [HANG],
}
AFTER_FIRST = {
    "ok": lambda: [ev("a"), ev("b", finish="stop", completion=2)],
    "unreachable": lambda: [ev("a"), _unreachable()],
    "process died": lambda: [ev("a"), ModelProcessDied("the model process of 'tiny' died")],
    "worker error": lambda: [ev("a"), worker_error("inference_error", "boom")],
    "upstream cancelled": lambda: [ev("a"), asyncio.CancelledError()],
    "inter-chunk timeout": lambda: [ev("a"), HANG],
    "no closing event": lambda: [ev("a")],
}


@pytest.mark.parametrize("stream", [False, True], ids=["blocking", "stream"])
@pytest.mark.parametrize("script", [*BEFORE_FIRST.values(), *AFTER_FIRST.values()],
                         ids=[*(f"before first, {k}" for k in BEFORE_FIRST),
                              *(f"after first, {k}" for k in AFTER_FIRST)])
async def test_the_count_returns_to_zero_however_the_request_ends(make_gateway, script, stream):
    gw = await make_gateway(first_chunk_timeout_s=0.2, overall_timeout_s=2.0, model_reload=False)
    gw.fake().script = script()
    # a blocking request is held to the inter-chunk bound only when it asks for it (gateway/service.py)
    resp = await gw.generate(stream=stream, options={"inter_chunk_timeout_s": 0.2})
    assert resp.status_code in (200, 408, 500, 502, 503, 504), resp.text
    (call,) = gw.calls
    assert call.closed
    assert _counts(gw) == [0]


async def test_a_fail_over_gives_back_the_failed_endpoints_count(make_gateway):
    gw = await make_gateway(pools=(one_pool(EndpointConfig(url="a"), EndpointConfig(url="b")),))
    tries: list[str] = []

    def first_try_fails(req):
        tries.append("try")
        return [_unreachable()] if len(tries) == 1 else [ev("ok", finish="stop", completion=1)]

    for url in ("a", "b"):
        gw.fake(url).script = first_try_fails
    resp = await gw.chat()
    assert resp.status_code == 200, resp.text
    assert len(gw.calls) == 2
    assert _counts(gw) == [0, 0]


@pytest.mark.parametrize("stream", [False, True], ids=["blocking", "stream"])
async def test_a_session_holds_the_count_until_the_client_leaves(gw, stream):
    """Taken when the stream opens, still held by the session that streams it, given back when it ends."""
    gw.fake().script = [ev("first", prompt=1), HANG]
    body = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "stream": stream}
    exchange, run = raw_call(gw.app, "/v1/chat/completions", body)
    task = asyncio.ensure_future(run())
    await asyncio.wait_for(_first_sent(gw), 2)
    await asyncio.sleep(0.05)
    assert _counts(gw) == [1]
    exchange.disconnect.set()
    await asyncio.wait_for(task, 2)
    assert gw.calls[0].closed
    assert _counts(gw) == [0]


async def test_a_request_cancelled_before_its_first_token_gives_the_count_back(gw):
    """The task itself is cancelled (a worker stopping) while the model has not answered yet."""
    gw.fake().script = [HANG]
    body = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "stream": True}
    _, run = raw_call(gw.app, "/v1/chat/completions", body)
    task = asyncio.ensure_future(run())
    await asyncio.wait_for(_called(gw), 2)
    assert _counts(gw) == [1]
    task.cancel()
    await asyncio.wait_for(asyncio.gather(task, return_exceptions=True), 2)
    assert gw.calls[0].closed
    assert _counts(gw) == [0]


async def _first_sent(gw) -> None:
    while not gw.calls:
        await asyncio.sleep(0.01)
    await gw.calls[0].first_sent.wait()


async def _called(gw) -> None:
    while not gw.calls:
        await asyncio.sleep(0.01)
    await asyncio.sleep(0.05)


async def test_a_claim_is_taken_once_and_given_back_once(gw):
    """The object itself: a second release, or leaving the block after a hand-over, changes nothing."""
    endpoint = gw.registry.endpoints[0]
    closed: list[bool] = []

    async def events():
        try:
            yield ev("a")
        finally:
            closed.append(True)

    stream = events()
    await anext(stream)
    async with InFlight(endpoint, stream) as claim:
        kept = claim.hand_over()
    assert endpoint.outstanding == 1 and kept.held
    await kept.release()
    await kept.release()
    assert endpoint.outstanding == 0 and not kept.held
    assert closed == [True]  # the stream was closed with it, once
    with pytest.raises(RuntimeError):
        async with kept:
            pass
    assert endpoint.outstanding == 0


@pytest.mark.parametrize("answered", [False, True], ids=["queued", "answering"])
async def test_a_blocking_request_cancelled_while_it_waits_gives_the_count_back(gw, answered):
    """The handler's task is cancelled (a worker stopping) while a blocking request waits for its first token or
    for the rest of its answer: the wait on the model is cancelled with it and the Triton call is closed."""
    gw.fake().script = [ev("first", prompt=1), HANG] if answered else [HANG]
    body = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}]}
    _, run = raw_call(gw.app, "/v1/chat/completions", body)
    task = asyncio.ensure_future(run())
    await asyncio.wait_for(_first_sent(gw) if answered else _called(gw), 2)
    await asyncio.sleep(0.05)
    task.cancel()
    await asyncio.wait_for(asyncio.gather(task, return_exceptions=True), 2)
    assert gw.calls[0].closed
    assert _counts(gw) == [0]
