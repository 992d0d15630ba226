"""A pool whose endpoints come from DNS (a headless Service name), re-resolved as pods come and go.

The resolver is the test's: it answers what the test says the name resolves to right now."""

from __future__ import annotations

import asyncio

import httpx
import pytest

from gateway.app import create_app
from gateway.disconnect import DisconnectAware
from gateway.discovery import resolve_dns
from gateway.profile import ModelProfile
from gateway.registry import ModelRegistry
from gateway.router import Router, RoutingHints
from gateway.settings import PoolConfig, Settings
from tests.helpers.sse import data_events, parse_sse
from tests.integration.conftest import BASE_PARAMS, MODEL, TRITON_MODEL, Delay, FakeTriton, tokens

DNS = "sie-triton:8001"


class Resolver:
    """What `sie-triton` resolves to: the test edits `addresses` or sets `failure`."""

    def __init__(self, *addresses: str) -> None:
        self.addresses = list(addresses)
        self.failure: OSError | None = None
        self.asked: list[tuple[str, int]] = []

    async def __call__(self, host: str, port: int) -> list[str]:
        self.asked.append((host, port))
        if self.failure is not None:
            raise self.failure
        return list(self.addresses)


class DnsGateway:
    def __init__(self, resolver: Resolver, **pool: object) -> None:
        self.fakes: dict[str, FakeTriton] = {}
        self.resolver = resolver
        settings = Settings(pools=(PoolConfig("default", dns=DNS, dns_refresh_s=0.0, **pool),))  # type: ignore[arg-type]
        self.registry = ModelRegistry(settings, client_factory=self._client, resolver=resolver)
        self.client = httpx.AsyncClient(transport=httpx.ASGITransport(app=DisconnectAware(
            create_app(settings, self.registry))), base_url="http://gateway")

    def _client(self, url: str) -> FakeTriton:
        assert url not in self.fakes or self.fakes[url].closed, f"two live clients for {url}"
        self.fakes[url] = FakeTriton(url)
        return self.fakes[url]

    def urls(self) -> set[str]:
        return {e.config.url for e in self.registry.endpoints}

    def first_choice(self, key: str) -> str:
        profile = ModelProfile.from_triton_config(TRITON_MODEL, dict(BASE_PARAMS))
        return Router(self.registry).candidates(profile, RoutingHints(affinity_key=key))[0].config.url

    async def chat(self, **body: object) -> httpx.Response:
        return await self.client.post("/v1/chat/completions", json={
            "model": MODEL, "messages": [{"role": "user", "content": "hi"}], **body})


async def test_each_address_of_the_name_is_an_endpoint_and_serves():
    gw = DnsGateway(Resolver("10.0.0.1", "10.0.0.2", "10.0.0.3"))
    await gw.registry.refresh()
    assert gw.urls() == {"10.0.0.1:8001", "10.0.0.2:8001", "10.0.0.3:8001"}
    assert gw.resolver.asked[0] == ("sie-triton", 8001)
    for i in range(24):
        assert (await gw.chat(routing_key=f"k{i}")).status_code == 200
    assert {url for url, fake in gw.fakes.items() if fake.calls} == gw.urls()
    assert (await gw.client.get("/readyz")).status_code == 200


async def test_pods_that_come_and_go_are_added_and_dropped():
    resolver = Resolver("10.0.0.1", "10.0.0.2")
    gw = DnsGateway(resolver)
    await gw.registry.refresh()
    resolver.addresses = ["10.0.0.2", "10.0.0.3"]
    await gw.registry.refresh()
    assert gw.urls() == {"10.0.0.2:8001", "10.0.0.3:8001"}
    assert gw.fakes["10.0.0.1:8001"].closed and not gw.fakes["10.0.0.2:8001"].closed
    assert all(e.healthy for e in gw.registry.endpoints)  # the new pod was asked for its models at once
    for i in range(16):
        assert (await gw.chat(routing_key=f"k{i}")).status_code == 200
    assert not gw.fakes["10.0.0.1:8001"].calls


async def test_rendezvous_affinity_moves_only_the_keys_of_the_pods_that_changed():
    resolver = Resolver("10.0.0.1", "10.0.0.2", "10.0.0.3")
    gw = DnsGateway(resolver)
    await gw.registry.refresh()
    keys = [f"user-{i}" for i in range(600)]
    before = {k: gw.first_choice(k) for k in keys}
    assert set(before.values()) == gw.urls()  # every pod owns some keys

    resolver.addresses = ["10.0.0.1", "10.0.0.2", "10.0.0.3", "10.0.0.4"]  # scale up
    await gw.registry.refresh()
    grown = {k: gw.first_choice(k) for k in keys}
    moved = {k for k in keys if grown[k] != before[k]}
    assert moved and {grown[k] for k in moved} == {"10.0.0.4:8001"}
    assert 0.15 < len(moved) / len(keys) < 0.35  # about a quarter: its fair share, taken from all three

    resolver.addresses = ["10.0.0.1", "10.0.0.3", "10.0.0.4"]  # a pod goes
    await gw.registry.refresh()
    shrunk = {k: gw.first_choice(k) for k in keys}
    moved = {k for k in keys if shrunk[k] != grown[k]}
    assert moved == {k for k in keys if grown[k] == "10.0.0.2:8001"}


async def test_a_dns_failure_keeps_the_endpoints_and_a_name_with_no_pods_is_provisioning():
    resolver = Resolver("10.0.0.1")
    gw = DnsGateway(resolver)
    await gw.registry.refresh()
    resolver.failure = OSError("Temporary failure in name resolution")
    await gw.registry.refresh()
    assert gw.urls() == {"10.0.0.1:8001"}
    assert (await gw.chat()).status_code == 200

    resolver.failure, resolver.addresses = None, []  # the Service has no ready pod
    await gw.registry.refresh()
    assert gw.urls() == set()
    resp = await gw.chat()
    assert resp.status_code == 503 and resp.json()["error"]["code"] == "PROVISIONING"
    assert (await gw.client.get("/readyz")).status_code == 503


async def test_a_pod_dropped_from_dns_finishes_its_streams_then_its_client_closes():
    resolver = Resolver("10.0.0.1")
    gw = DnsGateway(resolver)
    await gw.registry.refresh()
    pod = gw.fakes["10.0.0.1:8001"]
    pod.script = [step for token in tokens("one", " two", " three") for step in (token, Delay(0.2))]
    stream = asyncio.create_task(gw.chat(stream=True))
    while not (pod.calls and pod.calls[0].first_sent.is_set()):
        await asyncio.sleep(0.01)
    resolver.addresses = ["10.0.0.2"]  # the pod is draining: not ready, so not in DNS
    await gw.registry.refresh()
    assert gw.urls() == {"10.0.0.2:8001"} and not pod.closed
    body = (await stream).text
    events = data_events(parse_sse(body))
    assert events[-1] == "[DONE]"
    assert "".join(e["choices"][0]["delta"].get("content", "") for e in events[:-1] if e["choices"]) \
        == "one two three"
    await gw.registry.refresh()
    assert pod.closed


async def test_the_system_resolver():
    assert "127.0.0.1" in await resolve_dns("localhost", 8001)
    assert await resolve_dns("no-such-service.invalid", 8001) == []


def test_routing_file_with_a_dns_pool(tmp_path):
    path = tmp_path / "routing.yaml"
    path.write_text("pools:\n  default:\n    dns: sie-triton.sie.svc:8001\n    dns_refresh_s: 2\n")
    (pool,) = Settings.from_env({"SIE_GATEWAY_CONFIG": str(path)}).pools
    assert (pool.dns, pool.dns_refresh_s, pool.endpoints) == ("sie-triton.sie.svc:8001", 2.0, ())
    path.write_text("pools:\n  default:\n    dns: sie-triton\n")
    with pytest.raises(ValueError, match="host:port"):
        Settings.from_env({"SIE_GATEWAY_CONFIG": str(path)})
