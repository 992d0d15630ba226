"""The ASGI callable a worker serves: the HTTP app and the cluster status feed behind one entry."""

from __future__ import annotations

from gateway.auth import Authenticator
from gateway.drain import Drain
from gateway.resources.cluster_status import ClusterStatusFeed


class Served:
    """WebSocket handshakes go to the status feed, HTTP and lifespan to the Falcon app behind the disconnect tracker
    (the app's lifespan starts the registry both read).

    Its `drain` is what the worker's SIGTERM handler starts, its `auth` what SIGHUP tells to re-read the keys
    file (gateway/worker.py); uvicorn itself closes open WebSockets (1012) when the worker stops."""

    def __init__(self, http, websocket: ClusterStatusFeed, drain: Drain, auth: Authenticator) -> None:
        self.http, self.websocket, self.drain, self.auth = http, websocket, drain, auth

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] == "websocket":
            await self.websocket(scope, receive, send)
        else:
            await self.http(scope, receive, send)
