"""The gateway keeps nothing per request (what a 15-minute soak checks from outside): after a warm-up, a thousand more
requests (both contracts, streamed and blocking, errors included) leave no growing label sets, caches, queues or tasks.

Requests go straight to the ASGI app (no HTTP client whose own caches would blur the count)."""

from __future__ import annotations

import gc
import json
import tracemalloc
import weakref
from typing import Any

from tests.integration.conftest import MODEL, SIE_MODEL, tokens

CHAT = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}]}


class _Connection:
    """What uvicorn's request cycle holds: the scope, and the `receive` the app is handed (a bound method)."""

    def __init__(self, path: str, body: bytes, headers: dict[str, str] | None = None) -> None:
        self.scope = {
            "type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "method": "POST", "scheme": "http",
            "path": path, "raw_path": path.encode(), "query_string": b"", "root_path": "",
            "server": ("gateway", 80), "client": ("127.0.0.1", 5000),
            "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
                        *((k.lower().encode(), v.encode()) for k, v in (headers or {}).items())],
        }
        self.messages = [{"type": "http.request", "body": body, "more_body": False}]
        self.status = 0

    async def receive(self) -> dict[str, Any]:
        return self.messages.pop() if self.messages else {"type": "http.disconnect"}

    async def send(self, message: dict[str, Any]) -> None:
        if message["type"] == "http.response.start":
            self.status = message["status"]


async def _call(app: Any, path: str, body: bytes, headers: dict[str, str] | None = None) -> int:
    connection = _Connection(path, body, headers)
    await app(connection.scope, connection.receive, connection.send)
    return connection.status


def _native(**body: Any) -> bytes:
    return json.dumps({"prompt": "x", "max_new_tokens": 30, **body}).encode()


async def _traffic(gw, rounds: int) -> None:
    app = gw.app
    for i in range(rounds):
        statuses = [
            await _call(app, "/v1/chat/completions", json.dumps({**CHAT, "stream": True}).encode()),
            await _call(app, "/v1/chat/completions", json.dumps({**CHAT, "user": f"user-{i}"}).encode()),
            await _call(app, f"/v1/generate/{SIE_MODEL}", _native(stream=True, routing_key=f"k{i}")),
            await _call(app, f"/v1/generate/{SIE_MODEL}", _native(options={"overall_timeout_s": 30})),
            await _call(app, f"/v1/generate/acme__Nope-{i}", b"{}"),  # a distinct unknown id per request
            await _call(app, "/v1/generate/x", b"{", {"X-SIE-SDK-Version": f"0.{i}.0"}),
        ]
        assert statuses == [200, 200, 200, 200, 404, 404], statuses
        for fake in gw.fakes.values():
            fake.calls.clear()  # the fake's own record of calls is not the gateway's


async def test_requests_leave_nothing_behind(gw):
    gw.fake().script = lambda req: tokens(*["tok"] * 20)
    await _traffic(gw, 100)
    gc.collect()
    tracemalloc.start()
    try:
        before = tracemalloc.take_snapshot()
        await _traffic(gw, 170)  # ~1,000 requests
        gc.collect()
        after = tracemalloc.take_snapshot()
    finally:
        tracemalloc.stop()
    stats = after.filter_traces([tracemalloc.Filter(False, "*/tracemalloc.py")]).compare_to(
        before.filter_traces([tracemalloc.Filter(False, "*/tracemalloc.py")]), "lineno")
    growth = sum(stat.size_diff for stat in stats)
    # measured: about 4 kB of event-loop noise; one leaked path string per request is about 65 kB
    assert growth < 30_000, f"the gateway kept {growth} bytes over ~1,000 requests: {[str(s) for s in stats[:5]]}"


async def test_a_finished_request_leaves_no_reference_cycle_to_its_connection(gw):
    """Without a cycle, a connection's state goes the moment uvicorn drops it, not at a full gc pass: the
    disconnect watcher the gateway puts in the scope must not keep `receive`, and so the connection, alive."""
    gw.fake().script = lambda req: tokens(*["tok"] * 5)
    requests = [("/v1/chat/completions", json.dumps({**CHAT, "stream": True}).encode()),
                ("/v1/chat/completions", json.dumps(CHAT).encode()),
                (f"/v1/generate/{SIE_MODEL}", _native(stream=True)),
                (f"/v1/generate/{SIE_MODEL}", _native())]
    gc.collect()
    gc.disable()
    try:
        for path, body in requests:
            connection = _Connection(path, body)
            await gw.app(connection.scope, connection.receive, connection.send)
            assert connection.status == 200, path
            gone = weakref.ref(connection)
            del connection
            assert gone() is None, f"{path}: the connection outlived the request (held in a reference cycle)"
    finally:
        gc.enable()
