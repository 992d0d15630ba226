"""WS /ws/cluster-status (docs/contract.md, "Health and operational routes"): the cluster as `/health` reports it,
pushed once a second.

The real `sie-sdk`'s `client.watch()` opens it when `/health` says `type: gateway`; each message is a
`ClusterStatusMessage` (`timestamp`, `cluster`, `workers`, `models`), here with `/health`'s other fields beside them.

A raw ASGI endpoint, not a Falcon responder: Falcon can only refuse a handshake with a close (the client sees a
bare 403), while the contract answers a missing token with a 401 in its envelope. uvicorn's
`websocket.http.response` extension sends that answer here; a server without it gets the close.

Auth is the operational routes' (docs/contract.md, "Auth": `/ws/*` is open only with `SIE_AUTH_EXEMPT_OPERATIONAL`).
The registry is read as `/health` reads it, refreshed at most once a second however many clients watch, and
each worker process holds at most `MAX_WATCHERS` feeds: a watcher costs a task and a message a second.
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from typing import Any

import orjson

from gateway.auth import Authenticator
from gateway.errors import GatewayError, NotFound, Unavailable
from gateway.registry import ModelRegistry
from gateway.resources.health import READY_MAX_AGE_S, gateway_health

log = logging.getLogger(__name__)

PATH = "/ws/cluster-status"
MAX_WATCHERS = 64


class ClusterStatusFeed:
    """The ASGI callable for every WebSocket handshake this gateway gets (`/ws/cluster-status` is the one route)."""

    def __init__(self, registry: ModelRegistry, auth: Authenticator, *, server_version: str = "",
                 interval_s: float = 1.0, max_watchers: int = MAX_WATCHERS) -> None:
        self.registry = registry
        self.auth = auth
        self.server_version = server_version
        self.interval_s = interval_s
        self.max_watchers = max_watchers
        self.watchers = 0

    async def __call__(self, scope, receive, send) -> None:
        if (await receive())["type"] != "websocket.connect":
            return
        try:
            self._admit(scope)
        except GatewayError as error:
            await self._refuse(scope, send, error)
            return
        self.watchers += 1
        try:
            await send({"type": "websocket.accept"})
            await self._feed(receive, send)
        except OSError:  # the client went away mid-send (uvicorn's ClientDisconnected is an OSError)
            pass
        finally:
            self.watchers -= 1

    def _admit(self, scope) -> None:
        if scope["path"].rstrip("/") != PATH:
            raise NotFound(f"no WebSocket route at {scope['path'][:64]!r}; the status feed is {PATH}")
        headers = {name.decode("latin-1").lower(): value.decode("latin-1") for name, value in scope["headers"]}
        self.auth.check(PATH, headers.get("authorization"), headers.get("x-api-key"))
        if self.watchers >= self.max_watchers:
            raise Unavailable(f"this gateway worker already feeds {self.max_watchers} status watchers",
                              code="RESOURCE_EXHAUSTED", retry_after=5)

    async def _refuse(self, scope, send, error: GatewayError) -> None:
        """The handshake's answer is the error as an HTTP response in the contract's envelope, with the headers every
        HTTP answer carries, where the server can; a close code (3000 + status) where it cannot."""
        if "websocket.http.response" not in scope.get("extensions", {}):
            await send({"type": "websocket.close", "code": 3000 + error.status})
            return
        body = orjson.dumps(error.body())
        headers = {"content-type": "application/json", "content-length": str(len(body)),
                   "x-sie-request-id": uuid.uuid4().hex, "x-sie-server-version": self.server_version,
                   "x-sie-version": self.server_version, **error.headers()}
        await send({"type": "websocket.http.response.start", "status": error.status,
                    "headers": [(name.lower().encode(), value.encode()) for name, value in headers.items()]})
        await send({"type": "websocket.http.response.body", "body": body})

    async def _feed(self, receive, send) -> None:
        gone = asyncio.ensure_future(_until_disconnect(receive))
        try:
            while not gone.done():
                await self.registry.refresh_if_stale(max_age_s=READY_MAX_AGE_S)
                await send({"type": "websocket.send", "text": orjson.dumps(status_message(self.registry)).decode()})
                await asyncio.wait({gone}, timeout=self.interval_s)
        finally:
            gone.cancel()


def status_message(registry: ModelRegistry) -> dict[str, Any]:
    """One feed message: a timestamp (Unix seconds) and the body `/health` would answer now."""
    return {"timestamp": time.time(), **gateway_health(registry)}


async def _until_disconnect(receive) -> None:
    """Reads (and drops) whatever the client sends, until it closes: a feed takes no input."""
    while (await receive())["type"] != "websocket.disconnect":
        pass


