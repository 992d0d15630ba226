"""The gateway's uvicorn protocol bounds every connection in time and lets go of it the moment it ends.

A real uvicorn server (uvloop, httptools) in a thread, driven by raw sockets: a client that reads a whole
response and then resets the connection (what `requests` does when it stops reading a stream at `[DONE]`),
one that connects and sends nothing, one that trickles its headers (slowloris)."""

from __future__ import annotations

import asyncio
import contextlib
import gc
import signal
import socket
import struct
import threading
import time
from collections.abc import Iterator

import pytest
import uvicorn
from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

from devstack.net import free_port
from gateway.drain import Drain
from gateway.worker import DrainingServer, GatewayHttpProtocol, GatewayWorker
from tests.helpers.waiting import poll, wait_until

KEEP_ALIVE_S = 60  # far longer than the test: a protocol still alive at the end is held by its timer


BODY = b"data: [DONE]\n\n"


async def _app(scope, receive, send) -> None:
    await receive()
    if scope["path"] == "/slow":
        await asyncio.sleep(1.0)
    await send({"type": "http.response.start", "status": 200,
                "headers": [(b"content-type", b"text/event-stream"), (b"content-length", b"%d" % len(BODY))]})
    await send({"type": "http.response.body", "body": BODY})


@contextlib.contextmanager
def _serving(protocol: type, keep_alive_s: float = KEEP_ALIVE_S) -> Iterator[int]:
    port = free_port()
    server = uvicorn.Server(uvicorn.Config(_app, host="127.0.0.1", port=port, http=protocol, loop="uvloop",
                                           lifespan="off", log_level="warning", timeout_keep_alive=keep_alive_s))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    wait_until(lambda: server.started, 10, "uvicorn did not start", interval_s=0.02)
    try:
        yield port
    finally:
        server.should_exit = True
        thread.join(10)


def _get(sock: socket.socket, path: str) -> bytes:
    """One request on the connection; the whole response."""
    sock.sendall(f"GET {path} HTTP/1.1\r\nHost: gateway\r\n\r\n".encode())
    sock.settimeout(5)
    received = b""
    while not received.endswith(BODY):
        chunk = sock.recv(65536)
        assert chunk, f"{path}: the server closed first: {received!r}"
        received += chunk
    return received


def _request_then_reset(port: int) -> None:
    with socket.create_connection(("127.0.0.1", port)) as sock:
        _get(sock, "/stream")
        # linger 0: close with a reset instead of a FIN
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))


def _alive(protocol: type) -> int:
    gc.collect()
    return sum(1 for obj in gc.get_objects() if type(obj) is protocol)


def _alive_after_resets(protocol: type, connections: int) -> int:
    with _serving(protocol) as port:
        for _ in range(connections):
            _request_then_reset(port)
        # the server sees each reset a moment after the client sends it
        return poll(lambda: _alive(protocol), 3, until=lambda alive: not alive, interval_s=0.05)


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


def _read_until_closed(sock: socket.socket, within_s: float) -> bytes:
    """Everything the server sends until it closes; fails if it is still open after `within_s`."""
    sock.settimeout(within_s)
    received = b""
    try:
        while chunk := sock.recv(65536):
            received += chunk
    except TimeoutError:
        raise AssertionError(f"still open after {within_s} s; received {received!r}") from None
    return received


def _still_open_after(sock: socket.socket, seconds: float) -> bool:
    sock.settimeout(seconds)
    try:
        return sock.recv(1) != b""
    except TimeoutError:
        return True


FAST_HEADERS = type("FastHeaderTimeout", (GatewayHttpProtocol,), {"header_timeout_s": 0.5})


@pytest.mark.parametrize("protocol, closed", [(HttpToolsProtocol, False), (GatewayHttpProtocol, True)],
                         ids=["uvicorn-as-shipped", "gateway"])
def test_a_connection_that_sends_nothing_is_closed_after_the_keep_alive(protocol, closed):
    with _serving(protocol, keep_alive_s=1) as port, socket.create_connection(("127.0.0.1", port)) as sock:
        if closed:
            assert _read_until_closed(sock, within_s=5) == b""
        else:  # the reference: uvicorn as shipped holds a silent socket past its keep-alive
            assert _still_open_after(sock, 2.5)


def test_headers_trickled_past_the_header_timeout_get_a_408_and_a_close():
    with _serving(FAST_HEADERS) as port, socket.create_connection(("127.0.0.1", port)) as sock:
        sock.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: gateway\r\n")  # ...and no more
        started = time.monotonic()
        answer = _read_until_closed(sock, within_s=5)
        assert answer.startswith(b"HTTP/1.1 408 "), answer
        assert b"connection: close" in answer.lower()
        assert time.monotonic() - started > 0.4  # the header timeout's 408, not the keep-alive's silent close


def test_the_header_timeout_bounds_only_the_headers():
    """A response slower than the header timeout is not cut, and a kept-alive connection idle for longer than
    it between requests still serves the next one (idle time is the keep-alive's)."""
    with _serving(FAST_HEADERS) as port, socket.create_connection(("127.0.0.1", port)) as sock:
        for path, pause_after in (("/slow", 1.0), ("/", 0.0)):
            received = _get(sock, path)
            assert received.startswith(b"HTTP/1.1 200 "), received
            time.sleep(pause_after)


SMALL_HEADERS = type("SmallHeaderLimit", (GatewayHttpProtocol,), {"max_header_bytes": 8192})


@pytest.mark.parametrize("size", [20_000, 4 * 1024 * 1024], ids=["just-over", "4MB"])
def test_headers_over_the_limit_get_a_431_and_a_close(size):
    """httptools buffers a header whole before handing it over: without a limit the server holds 4 MB (or
    100 MB) of one header and keeps reading; with it, the client gets a 431 at the limit."""
    with _serving(SMALL_HEADERS) as port, socket.create_connection(("127.0.0.1", port)) as sock:
        request = b"GET / HTTP/1.1\r\nHost: gateway\r\nX-SIE-MACHINE-PROFILE: " + b"a" * size
        with contextlib.suppress(OSError):  # the server may close before it has read everything
            sock.sendall(request)  # ...and the headers never end
        answer = _read_until_closed(sock, within_s=5)
        assert answer.startswith(b"HTTP/1.1 431 "), answer[:200]
        head, _, body = answer.partition(b"\r\n\r\n")
        assert b"x-sie-error-code: invalid_request" in head.lower()
        assert b"connection: close" in head.lower()
        assert b'"code":"invalid_request"' in body and b"8192 bytes" in body
        assert len(answer) < 1024  # nothing of what was sent comes back


def test_headers_under_the_limit_with_a_large_body_are_served():
    """Only the request line and headers count: a body arriving in the same reads does not."""
    body = b"x" * 200_000
    with _serving(SMALL_HEADERS) as port, socket.create_connection(("127.0.0.1", port)) as sock:
        sock.sendall(b"POST / HTTP/1.1\r\nHost: gateway\r\nX-Pad: " + b"p" * 7000 +
                     b"\r\nContent-Length: %d\r\n\r\n" % len(body) + body)
        sock.settimeout(5)
        received = b""
        while not received.endswith(BODY):
            chunk = sock.recv(65536)
            assert chunk, received
            received += chunk
        assert received.startswith(b"HTTP/1.1 200 "), received[:200]


class _RecordingDrain(Drain):
    """The app's drain, which records whether the server still accepted when readiness began to fail."""

    def __init__(self, server_ref: list) -> None:
        super().__init__()
        self.server_ref, self.serving_at_begin = server_ref, None

    def begin(self, graceful_s: float) -> None:
        self.serving_at_begin = [s.is_serving() for s in self.server_ref[0].servers]
        super().begin(graceful_s)


def test_sigterm_stops_accepting_before_readiness_fails():
    """A client that has seen `/readyz` fail must not get a new connection to this worker (uvicorn alone stops
    accepting at its next tick, up to 100 ms after the signal)."""
    listener = socket.create_server(("127.0.0.1", 0))  # gunicorn binds the socket and hands it to the worker
    port = listener.getsockname()[1]
    server_ref: list = []
    drain = _RecordingDrain(server_ref)

    async def app(scope, receive, send) -> None:
        await _app(scope, receive, send)

    app.drain = drain  # type: ignore[attr-defined]
    server = DrainingServer(uvicorn.Config(app, loop="uvloop", lifespan="off", log_level="warning"), graceful_s=30)
    server_ref.append(server)
    thread = threading.Thread(target=lambda: asyncio.run(server.serve(sockets=[listener])), daemon=True)
    thread.start()
    deadline = time.monotonic() + 10
    wait_until(lambda: server.started, 10, "uvicorn did not start", interval_s=0.02)
    with socket.create_connection(("127.0.0.1", port), timeout=5) as sock:
        assert b" 200 " in _get(sock, "/")
    try:
        server.handle_exit(signal.SIGTERM, None)
        wait_until(lambda: drain.draining, deadline + 10 - time.monotonic(), "the drain did not begin",
                   interval_s=0.001)
        assert drain.serving_at_begin == [False]
        with pytest.raises(ConnectionRefusedError):
            socket.create_connection(("127.0.0.1", port), timeout=1).close()
    finally:
        server.should_exit = True
        thread.join(10)
