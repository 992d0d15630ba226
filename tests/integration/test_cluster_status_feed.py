"""WS /ws/cluster-status: the `/health` body pushed once a second (what the sie-sdk's `watch()` reads), behind the
operational routes' auth, refused in the contract's envelope; driven as uvicorn drives an ASGI app."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import orjson

from gateway.app import create_asgi
from gateway.auth import Authenticator
from gateway.resources.cluster_status import ClusterStatusFeed
from gateway.resources.health import gateway_health
from gateway.settings import EndpointConfig, Settings
from tests.integration.conftest import MODEL, one_pool

HTTP_RESPONSE_EXTENSION = {"websocket.http.response": {}}


def handshake(path: str = "/ws/cluster-status", headers: dict[str, str] | None = None,
              extensions: dict[str, Any] | None = None) -> dict[str, Any]:
    return {"type": "websocket", "asgi": {"version": "3.0", "spec_version": "2.4"}, "http_version": "1.1",
            "scheme": "ws", "path": path, "raw_path": path.encode(), "query_string": b"", "root_path": "",
            "headers": [(b"host", b"gateway")] + [(k.lower().encode(), v.encode()) for k, v in (headers or {}).items()],
            "client": ("127.0.0.1", 50000), "server": ("127.0.0.1", 8080), "subprotocols": [],
            "extensions": HTTP_RESPONSE_EXTENSION if extensions is None else extensions}


class Client:
    """The client side of one connection: what the app sent, and a way to hang up."""

    def __init__(self) -> None:
        self.inbox: asyncio.Queue[dict[str, Any]] = asyncio.Queue()
        self.sent: list[dict[str, Any]] = []
        self.got_message = asyncio.Event()
        self.inbox.put_nowait({"type": "websocket.connect"})

    async def receive(self) -> dict[str, Any]:
        return await self.inbox.get()

    async def send(self, message: dict[str, Any]) -> None:
        self.sent.append(message)
        if message["type"] == "websocket.send":
            self.got_message.set()

    def hang_up(self) -> None:
        self.inbox.put_nowait({"type": "websocket.disconnect", "code": 1000})

    def messages(self) -> list[dict[str, Any]]:
        return [json.loads(m["text"]) for m in self.sent if m["type"] == "websocket.send"]

    def refusal(self) -> tuple[int, dict[str, str], dict[str, Any]]:
        start, body = self.sent
        assert (start["type"], body["type"]) == ("websocket.http.response.start", "websocket.http.response.body")
        headers = {k.decode(): v.decode() for k, v in start["headers"]}
        return start["status"], headers, orjson.loads(body["body"])


async def watch(app, client: Client, scope: dict[str, Any], messages: int = 1) -> asyncio.Task:
    """Open a feed and wait until it has sent `messages` messages."""
    task = asyncio.create_task(app(scope, client.receive, client.send))
    await wait_for_messages(client, task, messages)
    return task


async def wait_for_messages(client: Client, task: asyncio.Task, count: int) -> None:
    async with asyncio.timeout(5):
        while len(client.messages()) < count and not task.done():
            client.got_message.clear()
            await asyncio.wait({task, asyncio.ensure_future(client.got_message.wait())},
                               return_when=asyncio.FIRST_COMPLETED)


async def test_the_feed_pushes_the_health_body_with_a_timestamp_until_the_client_hangs_up(gw):
    feed = ClusterStatusFeed(gw.registry, Authenticator(gw.settings), interval_s=0.05)
    client = Client()
    task = await watch(feed, client, handshake(), messages=3)
    assert client.sent[0] == {"type": "websocket.accept"}
    first, *later = client.messages()
    assert set(first) >= {"timestamp", "cluster", "workers", "models"}  # the sie-sdk's ClusterStatusMessage
    assert {k: v for k, v in first.items() if k != "timestamp"} == gateway_health(gw.registry)
    assert first["type"] == "gateway" and first["status"] == "healthy"
    assert first["workers"][0]["loaded_models"] == [MODEL]
    assert [m["timestamp"] for m in later] == sorted(m["timestamp"] for m in later)
    assert later[0]["timestamp"] > first["timestamp"]
    assert feed.watchers == 1
    client.hang_up()
    await asyncio.wait_for(task, 5)  # the feed ends with the connection, nothing left running
    assert feed.watchers == 0


async def test_the_feed_follows_the_cluster(make_gateway):
    gw = await make_gateway(pools=(one_pool(EndpointConfig(url="a"), EndpointConfig(url="b")),))
    feed = ClusterStatusFeed(gw.registry, Authenticator(gw.settings), interval_s=0.05)
    client = Client()
    task = await watch(feed, client, handshake())
    assert client.messages()[0]["status"] == "healthy"
    gw.fake("b").down = True
    await gw.registry.refresh()
    await wait_for_messages(client, task, len(client.messages()) + 2)  # one may have been on its way already
    latest = client.messages()[-1]
    assert latest["status"] == "degraded"
    assert [(w["name"], w["healthy"]) for w in latest["workers"]] == [("a", True), ("b", False)]
    client.hang_up()
    await asyncio.wait_for(task, 5)


async def test_without_a_token_the_handshake_is_a_401_in_the_envelope(make_gateway):
    gw = await make_gateway(auth_mode="token", auth_tokens=("secret",))
    feed = ClusterStatusFeed(gw.registry, Authenticator(gw.settings), server_version=gw.settings.server_version)
    for headers, message in (({}, "Missing Authorization header"),
                             ({"Authorization": "Bearer wrong"}, "Invalid token")):
        client = Client()
        await asyncio.wait_for(feed(handshake(headers=headers), client.receive, client.send), 5)
        status, response_headers, body = client.refusal()
        assert status == 401
        assert body == {"error": {"message": message, "type": "authentication_error", "param": None,
                                  "code": "UNAUTHORIZED"}}
        assert response_headers["x-sie-error-code"] == "UNAUTHORIZED"
        assert response_headers["www-authenticate"].startswith("Bearer")
        assert response_headers["content-type"] == "application/json"
        # the headers every HTTP answer of this gateway carries (docs/contract.md, "Response headers")
        assert len(response_headers["x-sie-request-id"]) == 32
        assert response_headers["x-sie-server-version"] == gw.settings.server_version


async def test_a_valid_token_or_the_operational_exemption_admits(make_gateway):
    secured = await make_gateway(auth_mode="token", auth_tokens=("secret",))
    exempt = await make_gateway(auth_mode="token", auth_tokens=("secret",), auth_exempt_operational=True)
    for gw, headers in ((secured, {"Authorization": "Bearer secret"}), (secured, {"x-api-key": "secret"}),
                        (exempt, {})):
        feed = ClusterStatusFeed(gw.registry, Authenticator(gw.settings))
        client = Client()
        task = await watch(feed, client, handshake(headers=headers))
        assert client.sent[0] == {"type": "websocket.accept"} and client.messages()[0]["type"] == "gateway"
        client.hang_up()
        await asyncio.wait_for(task, 5)


async def test_a_server_without_the_http_response_extension_gets_a_close_code(make_gateway):
    gw = await make_gateway(auth_mode="token", auth_tokens=("secret",))
    client = Client()
    await asyncio.wait_for(ClusterStatusFeed(gw.registry, Authenticator(gw.settings))(
        handshake(extensions={}), client.receive, client.send), 5)
    assert client.sent == [{"type": "websocket.close", "code": 3401}]


async def test_other_websocket_paths_are_404(gw):
    client = Client()
    await asyncio.wait_for(ClusterStatusFeed(gw.registry, Authenticator(gw.settings))(
        handshake(path="/ws/status"), client.receive, client.send), 5)
    status, headers, body = client.refusal()
    assert status == 404 and body["error"]["code"] == "invalid_request"
    assert "/ws/cluster-status" in body["error"]["message"]


async def test_watchers_per_worker_are_bounded(gw):
    feed = ClusterStatusFeed(gw.registry, Authenticator(gw.settings), interval_s=0.05, max_watchers=2)
    watching = [Client(), Client()]
    tasks = [await watch(feed, c, handshake()) for c in watching]
    refused = Client()
    await asyncio.wait_for(feed(handshake(), refused.receive, refused.send), 5)
    status, headers, body = refused.refusal()
    assert status == 503 and body["error"]["code"] == "RESOURCE_EXHAUSTED" and headers["retry-after"]
    watching[0].hang_up()
    await asyncio.wait_for(tasks[0], 5)
    admitted = Client()
    tasks.append(await watch(feed, admitted, handshake()))  # a slot freed by a hang-up is free again
    assert admitted.sent[0] == {"type": "websocket.accept"}
    for c in (watching[1], admitted):
        c.hang_up()
    await asyncio.wait_for(asyncio.gather(*tasks), 5)


async def test_the_served_app_hands_websocket_handshakes_to_the_feed():
    """Before the feed, a WebSocket handshake reached the Falcon app, whose error handlers expect an HTTP response:
    every handshake raised AttributeError in the worker."""
    app = create_asgi(Settings(pools=(one_pool(EndpointConfig(url="127.0.0.1:9")),)))
    client = Client()
    task = await watch(app, client, handshake())
    assert client.sent[0] == {"type": "websocket.accept"}
    assert client.messages()[0]["status"] == "degraded"  # nothing reachable behind it, and it says so
    client.hang_up()
    await asyncio.wait_for(task, 10)
