"""The gunicorn worker class: uvicorn with the C HTTP parser (httptools) and uvloop.

uvicorn's defaults pick them only when installed; naming them here makes a missing dependency
fail at start instead of silently falling back to the pure-Python parser (several times slower).
"""

from __future__ import annotations

from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol
from uvicorn_worker import UvicornWorker


class GatewayHttpProtocol(HttpToolsProtocol):
    """uvicorn's httptools protocol, without one retention.

    uvicorn cancels the keep-alive timer only when a connection closes cleanly. A client that resets
    it instead (one that stops reading at `[DONE]` and closes with the chunked terminator unread, as
    `requests` does) leaves the timer pending, and the timer holds the protocol, its transport and
    its last request cycle (scope, headers, events) for the whole keep-alive: at a few requests a
    second that is a hundred dead connections per worker, churning the allocator. Behind a proxy that
    purges idle connections with a reset, that is every request (the same finding upstream of us:
    Soju06/codex-lb issue 2041, an OOM with a long keep-alive).
    """

    def connection_lost(self, exc: Exception | None) -> None:
        super().connection_lost(exc)
        self._unset_keepalive_if_required()


class GatewayWorker(UvicornWorker):
    CONFIG_KWARGS = {**UvicornWorker.CONFIG_KWARGS, "http": GatewayHttpProtocol, "loop": "uvloop"}
