"""The gateway's uvicorn protocol lets go of a connection the moment the client is gone.

A real uvicorn server (uvloop, httptools) in a thread; a raw socket client reads a whole response, then
resets the connection (what `requests` does when it stops reading a stream at `[DONE]`)."""

from __future__ import annotations

import gc
import socket
import struct
import threading
import time
from collections.abc import Iterator

import pytest
import uvicorn
from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

from devstack.net import free_port
from gateway.worker import GatewayHttpProtocol, GatewayWorker

KEEP_ALIVE_S = 60  # far longer than the test: a protocol still alive at the end is held by its timer


BODY = b"data: [DONE]\n\n"


async def _app(scope, receive, send) -> None:
    await receive()
    await send({"type": "http.response.start", "status": 200,
                "headers": [(b"content-type", b"text/event-stream"), (b"content-length", b"%d" % len(BODY))]})
    await send({"type": "http.response.body", "body": BODY})


def _serve(protocol: type) -> Iterator[int]:
    port = free_port()
    server = uvicorn.Server(uvicorn.Config(_app, host="127.0.0.1", port=port, http=protocol, loop="uvloop",
                                           lifespan="off", log_level="warning", timeout_keep_alive=KEEP_ALIVE_S))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 10
    while not server.started:
        assert time.monotonic() < deadline, "uvicorn did not start"
        time.sleep(0.02)
    try:
        yield port
    finally:
        server.should_exit = True
        thread.join(10)


def _request_then_reset(port: int) -> None:
    with socket.create_connection(("127.0.0.1", port)) as sock:
        sock.sendall(b"GET /stream HTTP/1.1\r\nHost: gateway\r\n\r\n")
        received = b""
        while not received.endswith(BODY):
            chunk = sock.recv(65536)
            assert chunk, f"the server closed first: {received!r}"
            received += chunk
        # linger 0: close with a reset instead of a FIN
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))


def _alive(protocol: type) -> int:
    gc.collect()
    return sum(1 for obj in gc.get_objects() if type(obj) is protocol)


def _alive_after_resets(protocol: type, connections: int) -> int:
    for port in _serve(protocol):
        for _ in range(connections):
            _request_then_reset(port)
        deadline = time.monotonic() + 3
        while _alive(protocol) and time.monotonic() < deadline:
            time.sleep(0.05)  # the server sees each reset a moment after the client sends it
        return _alive(protocol)
    raise AssertionError("unreachable")


def test_the_worker_runs_the_gateway_protocol_on_uvloop():
    assert GatewayWorker.CONFIG_KWARGS["http"] is GatewayHttpProtocol
    assert GatewayWorker.CONFIG_KWARGS["loop"] == "uvloop"
    assert issubclass(GatewayHttpProtocol, HttpToolsProtocol)  # the C parser, not the pure-Python one


@pytest.mark.parametrize("protocol, kept", [(HttpToolsProtocol, 10), (GatewayHttpProtocol, 0)],
                         ids=["uvicorn-as-shipped", "gateway"])
def test_a_reset_connection_is_released_at_once(protocol, kept):
    # uvicorn as shipped is the reference: its keep-alive timer keeps every reset connection, which shows
    # this test can see the retention it guards against
    assert _alive_after_resets(protocol, connections=10) == kept
