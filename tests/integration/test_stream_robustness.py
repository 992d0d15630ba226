"""Streams that end badly upstream, and streams read by slow clients."""

from __future__ import annotations

import asyncio
import json
import tracemalloc
from collections.abc import Iterator
from typing import Any

import pytest

from tests.helpers.sse import DONE, data_events, parse_sse
from tests.integration.conftest import MODEL, SIE_MODEL, assert_error, ev

CHAT = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}]}
GENERATE = {"prompt": "Once upon", "max_new_tokens": 2048}


# -- gRPC CANCELLED from Triton ----------------------------------------------------------------------

@pytest.mark.parametrize("route", ["chat", "generate"])
async def test_stream_that_triton_cancels_still_ends_with_error_and_one_done(make_gateway, route):
    gw = await make_gateway(keepalive_interval_s=0.05)
    # TritonClient turns a gRPC CANCELLED status into CancelledError; the gateway itself did not cancel
    gw.fake().script = [ev("a", prompt=1), ev("b", prompt=1), asyncio.CancelledError()]
    call = gw.chat(stream=True) if route == "chat" else gw.generate(stream=True)
    resp = await asyncio.wait_for(call, 3)  # before the fix: keep-alives forever
    items = data_events(parse_sse(resp.text))
    assert items.count(DONE) == 1 and items[-1] == DONE
    error = items[-2]["error"]
    assert error["code"] == "cancelled"
    assert gw.calls[0].closed


@pytest.mark.parametrize("when", ["before the first token", "after tokens"])
async def test_blocking_request_that_triton_cancels_is_an_error_response(gw, when):
    head = [] if when == "before the first token" else [ev("a", prompt=1)]
    gw.fake().script = [*head, asyncio.CancelledError()]
    for resp in (await asyncio.wait_for(gw.chat(), 3), await asyncio.wait_for(gw.generate(), 3)):
        assert_error(resp, 408, "cancelled", None, "server_error")


# -- slow readers ----------------------------------------------------------------------------------------

TOKENS = 2000


def long_generation(req: Any) -> Iterator[Any]:
    """2,000 deltas made as the gateway asks for them (so only what the gateway keeps stays in memory)."""
    for i in range(TOKENS - 1):
        yield ev(f" token{i:05d}", prompt=3)
    yield ev(" end", finish="length", prompt=3, completion=TOKENS)


async def _slow_read(app: Any, path: str, body: dict[str, Any]) -> tuple[str, int]:
    """Stream `path` with a client that takes 5 ms per body chunk; returns (body, traced memory growth)."""
    raw = json.dumps({**body, "stream": True}).encode()
    scope = {
        "type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "method": "POST", "scheme": "http",
        "path": path, "raw_path": path.encode(), "query_string": b"", "root_path": "",
        "server": ("gateway", 80), "client": ("127.0.0.1", 5000),
        "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(raw)).encode())],
    }
    received: list[bytes] = []
    peak = 0
    sent = False

    async def receive() -> dict[str, Any]:
        nonlocal sent
        if not sent:
            sent = True
            return {"type": "http.request", "body": raw, "more_body": False}
        await asyncio.Event().wait()
        return {"type": "http.disconnect"}

    async def send(message: dict[str, Any]) -> None:
        nonlocal peak
        if message["type"] == "http.response.body" and message.get("body"):
            received.append(message["body"])
            peak = max(peak, tracemalloc.get_traced_memory()[0])
            await asyncio.sleep(0.005)  # the slow reader

    tracemalloc.start()
    try:
        base = tracemalloc.get_traced_memory()[0]
        await asyncio.wait_for(app(scope, receive, send), 30)
        body = b"".join(received).decode()
    finally:
        tracemalloc.stop()
    # what the client itself kept (the bytes it read) is not the gateway's
    return body, peak - base - sum(len(b) + 33 for b in received)


@pytest.mark.parametrize(("path", "body", "field"), [
    (f"/v1/generate/{SIE_MODEL}", GENERATE, "text_delta"),
    ("/v1/chat/completions", {**CHAT, "max_tokens": 2048}, "content"),
])
async def test_slow_reader_keeps_gateway_memory_flat_and_loses_no_text(gw, path, body, field):
    gw.fake().script = long_generation
    text, growth = await _slow_read(gw.app, path, body)
    items = data_events(parse_sse(text))
    assert items.count(DONE) == 1 and items[-1] == DONE
    chunks = [i for i in items if i != DONE]
    if field == "content":
        joined = "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks if c["choices"])
    else:
        joined = "".join(c["text_delta"] for c in chunks)
    assert joined == "".join(f" token{i:05d}" for i in range(TOKENS - 1)) + " end"  # every delta, in order
    # measured: unbounded 350-700 kB (2,000 queued events); bounded about 125 kB
    assert growth < 220_000, f"gateway memory grew by {growth} bytes under a slow reader"
