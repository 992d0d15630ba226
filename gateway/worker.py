"""The gunicorn worker class: uvicorn with the C HTTP parser (httptools) and uvloop.

uvicorn's defaults pick them only when installed; naming them here makes a missing dependency
fail at start instead of silently falling back to the pure-Python parser (several times slower).

Environment (see `GatewayHttpProtocol`): GATEWAY_HEADER_TIMEOUT (30 s): how long a client may take to send a
request's headers, from its first byte; GATEWAY_MAX_HEADER_BYTES (65536): the most bytes a request line plus its
headers may take.
"""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import sys
from types import FrameType

from gunicorn.arbiter import Arbiter
from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol
from uvicorn.server import Server
from uvicorn_worker import UvicornWorker


def _header_timeout_from_env() -> float:
    raw = os.environ.get("GATEWAY_HEADER_TIMEOUT", "").strip()
    value = float(raw) if raw else 30.0
    if not value > 0:
        raise ValueError(f"GATEWAY_HEADER_TIMEOUT must be > 0 seconds, got {raw!r}")
    return value


def _max_header_bytes_from_env() -> int:
    raw = os.environ.get("GATEWAY_MAX_HEADER_BYTES", "").strip()
    value = int(raw) if raw else 64 * 1024
    if value < 1024:
        raise ValueError(f"GATEWAY_MAX_HEADER_BYTES must be >= 1024, got {raw!r}")
    return value


def _headers_too_large_response(limit: int) -> bytes:
    """431 in the contract's envelope (written by the protocol: the app never sees such a request)."""
    body = (b'{"error":{"message":"request line and headers exceed %d bytes","type":"invalid_request_error",'
            b'"param":null,"code":"invalid_request"}}' % limit)
    return (b"HTTP/1.1 431 Request Header Fields Too Large\r\ncontent-type: application/json\r\n"
            b"x-sie-error-code: invalid_request\r\ncontent-length: %d\r\nconnection: close\r\n\r\n%s"
            % (len(body), body))


# After a rejection, how long the rest of what the client is sending is read and dropped before the close (nginx's
# lingering close): closing with unread data sends a reset, which can destroy the response before the client reads it.
_LINGER_S = 2.0

_HEADER_TIMEOUT_BODY = b"request headers not received in time"
_HEADER_TIMEOUT_RESPONSE = (b"HTTP/1.1 408 Request Timeout\r\ncontent-type: text/plain; charset=utf-8\r\n"
                            b"content-length: %d\r\nconnection: close\r\n\r\n%s"
                            % (len(_HEADER_TIMEOUT_BODY), _HEADER_TIMEOUT_BODY))


class GatewayHttpProtocol(HttpToolsProtocol):
    """uvicorn's httptools protocol, with every connection bounded in time and released when it ends.

    - **A reset connection is released at once.** uvicorn cancels the keep-alive timer only when a
      connection closes cleanly. A client that resets it instead (one that stops reading at `[DONE]`
      and closes with the chunked terminator unread, as `requests` does) leaves the timer pending, and
      the timer holds the protocol, its transport and its last request cycle (scope, headers, events)
      for the whole keep-alive: at a few requests a second that is a hundred dead connections per
      worker, churning the allocator. Behind a proxy that purges idle connections with a reset, that
      is every request (the same finding upstream of us: an OOM with a long keep-alive in Soju06/codex-lb,
      github.com/Soju06/codex-lb/issues/2041).
    - **A connection that never sends a request is closed after the keep-alive**, as an idle one is
      between requests; uvicorn arms no timer until a first response, so it held such a socket forever.
    - **Request headers must arrive within `header_timeout_s`** of the request's first byte, or the
      client gets a 408 and the connection closes (nginx's `client_header_timeout`): a client that
      trickles headers (slowloris) cannot hold sockets open. The body and the generation are bounded
      by the gateway's own timeouts, not here.
    - **Request headers are bounded in size** (`max_header_bytes`, request line included): past it the client
      gets a 431 and the connection closes. httptools has no limit of its own and buffers a header value whole
      before handing it over, so a 100 MB header was held in memory; now at most the limit plus one read.
    """

    header_timeout_s: float = _header_timeout_from_env()
    max_header_bytes: int = _max_header_bytes_from_env()
    _header_timer: asyncio.TimerHandle | None = None  # set while a request's headers are arriving
    _header_bytes = 0
    _lingering: asyncio.TimerHandle | None = None  # set once the connection is rejected: input is dropped

    def connection_made(self, transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self.timeout_keep_alive_task = self.loop.call_later(self.timeout_keep_alive, self.timeout_keep_alive_handler)

    def data_received(self, data: bytes) -> None:
        if self._lingering is not None:
            return
        super().data_received(data)
        if self._header_timer is None or self.transport.is_closing():
            return  # not inside a request's headers (the body, or between requests)
        self._header_bytes += len(data)
        if self._header_bytes > self.max_header_bytes:
            self._stop_header_timer()
            self._reject(_headers_too_large_response(self.max_header_bytes))

    def on_message_begin(self) -> None:
        super().on_message_begin()
        self._header_bytes = 0
        self._stop_header_timer()
        self._header_timer = self.loop.call_later(self.header_timeout_s, self._headers_timed_out)

    def on_headers_complete(self) -> None:
        self._stop_header_timer()
        super().on_headers_complete()

    def connection_lost(self, exc: Exception | None) -> None:
        super().connection_lost(exc)
        self._unset_keepalive_if_required()
        self._stop_header_timer()
        if self._lingering is not None:
            self._lingering.cancel()

    def _stop_header_timer(self) -> None:
        if self._header_timer is not None:
            self._header_timer.cancel()
            self._header_timer = None

    def _headers_timed_out(self) -> None:
        self._header_timer = None
        if not self.transport.is_closing():
            self._reject(_HEADER_TIMEOUT_RESPONSE)

    def _reject(self, response: bytes) -> None:
        """Answer, then close: at once inside a pipelined response, else after a lingering read."""
        if self.cycle is not None and not self.cycle.response_complete:  # never inside a pipelined response
            self.transport.close()
            return
        self.transport.write(response)
        if not self.transport.can_write_eof():
            self.transport.close()
            return
        self.transport.write_eof()  # the client reads the answer, then our end; its own close ends the connection
        self._lingering = self.loop.call_later(_LINGER_S, self.transport.close)


class PathOnlyAccessLog(logging.Filter):
    """uvicorn's access line (`client - "METHOD path HTTP/v" status`) with the path alone: a query string can
    carry a credential (`?api_key=...`) or a prompt, and neither may reach a log."""

    def filter(self, record: logging.LogRecord) -> bool:
        args = record.args
        if isinstance(args, tuple) and len(args) >= 3 and isinstance(args[2], str) and "?" in args[2]:
            record.args = (*args[:2], args[2].split("?", 1)[0], *args[3:])
        return True


class DrainingServer(Server):
    """uvicorn's server, which also starts the app's drain on SIGTERM/SIGINT/SIGQUIT (gateway/drain.py).

    uvicorn itself closes idle connections and waits for the open ones; the drain makes `/readyz` fail and ends
    what is still streaming at the deadline, before gunicorn's SIGKILL. Accepting stops in the same callback, before
    `/readyz` fails: uvicorn would stop only at its next tick (up to 100 ms later), and a client that saw readiness
    fail could still open a connection to this worker in that gap."""

    def __init__(self, config, graceful_s: float) -> None:
        super().__init__(config)
        self.graceful_s = graceful_s
        self._loop: asyncio.AbstractEventLoop | None = None
        self._sockets: list = []

    async def serve(self, sockets=None) -> None:
        self._loop = asyncio.get_running_loop()
        self._sockets = list(sockets or [])
        auth = getattr(self.config.app, "auth", None)
        if auth is not None:
            # SIGHUP re-reads the keys file (the master forwards its own, docker/gunicorn.conf.py); without a
            # handler the signal's default would kill the worker
            self._loop.add_signal_handler(signal.SIGHUP, auth.reload_keys)
        await super().serve(sockets)

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        super().handle_exit(sig, frame)
        if self._loop is not None:
            self._loop.call_soon_threadsafe(self._stop_accepting_then_drain)

    def _stop_accepting_then_drain(self) -> None:
        for server in getattr(self, "servers", []):  # uvicorn's shutdown closes them again; both are idempotent
            server.close()
        for sock in self._sockets:  # this process's copy of gunicorn's listener
            sock.close()
        drain = getattr(self.config.app, "drain", None)
        if drain is not None:
            drain.begin(self.graceful_s)


class GatewayWorker(UvicornWorker):
    # websockets' sans-I/O protocol for /ws/cluster-status, named so that a missing `websockets` fails at start
    CONFIG_KWARGS = {**UvicornWorker.CONFIG_KWARGS, "http": GatewayHttpProtocol, "loop": "uvloop",
                     "ws": "websockets-sansio"}

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)  # points uvicorn's access logger at gunicorn's (GATEWAY_ACCESS_LOG)
        logging.getLogger("uvicorn.access").addFilter(PathOnlyAccessLog())

    async def _serve(self) -> None:  # UvicornWorker._serve, with the draining server
        self.config.app = self.wsgi
        server = DrainingServer(self.config, float(self.cfg.graceful_timeout))
        self._install_sigquit_handler()
        await server.serve(sockets=self.sockets)
        if not server.started:
            sys.exit(Arbiter.WORKER_BOOT_ERROR)
