"""The gateway's own request metrics for streams: a streamed answer is in flight until its body ends, and its latency
is measured to the last byte (Falcon sends `resp.stream` after the responder and the middleware have returned)."""

from __future__ import annotations

import asyncio

import pytest

from gateway.metrics import render_metrics
from gateway.settings import EndpointConfig, PoolConfig
from tests.helpers.prometheus import metric_value
from tests.integration.conftest import HANG, MODEL, SIE_MODEL, Delay, ev, one_pool, raw_call

# every route that streams, with the smallest streaming body each accepts
STREAMING_ROUTES = [
    ("chat", "/v1/chat/completions", {"model": MODEL, "messages": [{"role": "user", "content": "hi"}]}),
    ("completions", "/v1/completions", {"model": MODEL, "prompt": "Once upon"}),
    ("responses", "/v1/responses", {"model": MODEL, "input": "hi"}),
    ("generate", f"/v1/generate/{SIE_MODEL}", {"prompt": "Once upon", "max_new_tokens": 16}),
]
ROUTE_IDS = [route for route, _, _ in STREAMING_ROUTES]
STREAM_SECONDS = 0.4


def in_flight(route: str) -> float:
    return metric_value(render_metrics()[0].decode(), "sie_gateway_in_flight_requests", endpoint=route)


def latency(route: str) -> tuple[float, float]:
    """(count, sum) of the latency histogram of `route`."""
    text = render_metrics()[0].decode()
    return (metric_value(text, "sie_gateway_request_latency_seconds_count", endpoint=route),
            metric_value(text, "sie_gateway_request_latency_seconds_sum", endpoint=route))


async def finished(task: asyncio.Future) -> None:
    done, _ = await asyncio.wait({task}, timeout=2)
    assert task in done, "the app kept running"
    assert task.exception() is None


@pytest.mark.parametrize(("route", "path", "body"), STREAMING_ROUTES, ids=ROUTE_IDS)
async def test_stream_is_in_flight_until_its_body_ends_and_latency_covers_it(gw, route, path, body):
    gw.fake().script = [ev("Hel", prompt=3), Delay(STREAM_SECONDS), ev("lo", finish="stop", prompt=3, completion=2)]
    gauge, (count, total) = in_flight(route), latency(route)
    exchange, run = raw_call(gw.app, path, {**body, "stream": True})
    task = asyncio.ensure_future(run())
    await asyncio.wait_for(exchange.first_body.wait(), 2)
    assert exchange.status == 200 and exchange.headers["content-type"].startswith("text/event-stream")
    assert in_flight(route) == gauge + 1  # headers and a first chunk are out; the stream is still open
    assert latency(route)[0] == count  # nothing observed before the last byte
    await finished(task)
    assert in_flight(route) == gauge
    new_count, new_total = latency(route)
    assert new_count == count + 1
    assert new_total - total >= STREAM_SECONDS  # to the last byte, not to the response start


@pytest.mark.parametrize(("route", "path", "body"), STREAMING_ROUTES, ids=ROUTE_IDS)
async def test_stream_leaves_the_gauge_when_the_client_disconnects(gw, route, path, body):
    gw.fake().script = [ev("first", prompt=1), HANG]
    gauge, (count, _) = in_flight(route), latency(route)
    exchange, run = raw_call(gw.app, path, {**body, "stream": True})
    task = asyncio.ensure_future(run())
    await asyncio.wait_for(exchange.first_body.wait(), 2)
    await asyncio.sleep(0.05)  # a silent model: the stream stays open
    assert in_flight(route) == gauge + 1
    exchange.disconnect.set()
    await finished(task)
    assert in_flight(route) == gauge
    assert latency(route)[0] == count + 1  # a stream the client left is observed once, when it ends
    (call,) = gw.calls
    assert call.cancelled and call.closed


async def test_blocking_request_is_in_flight_while_it_waits_and_not_after(gw):
    gw.fake().script = [ev("Hel", prompt=3), Delay(0.2), ev("lo", finish="stop", prompt=3, completion=2)]
    gauge, (count, _) = in_flight("chat"), latency("chat")
    task = asyncio.ensure_future(gw.chat())
    await asyncio.sleep(0.1)
    assert in_flight("chat") == gauge + 1
    resp = await asyncio.wait_for(task, 2)
    assert resp.status_code == 200
    assert in_flight("chat") == gauge
    assert latency("chat")[0] == count + 1


async def test_streaming_error_before_the_first_byte_is_counted_once(gw):
    gauge, (count, _) = in_flight("generate"), latency("generate")
    resp = await gw.generate(model="acme__Missing", stream=True)
    assert resp.status_code == 404
    assert in_flight("generate") == gauge
    assert latency("generate")[0] == count + 1


async def test_stream_leaves_the_gauge_when_its_task_is_cancelled(gw):
    """A server that shuts down cancels the request's task mid-body: Falcon closes the body, the gauge drops."""
    gw.fake().script = [ev("first", prompt=1), HANG]
    gauge = in_flight("chat")
    exchange, run = raw_call(gw.app, "/v1/chat/completions", {**STREAMING_ROUTES[0][2], "stream": True})
    task = asyncio.ensure_future(run())
    await asyncio.wait_for(exchange.first_body.wait(), 2)
    assert in_flight("chat") == gauge + 1
    task.cancel()
    await asyncio.gather(task, return_exceptions=True)
    assert in_flight("chat") == gauge
    (call,) = gw.calls
    assert call.closed


async def test_the_contracts_metric_names_and_labels(make_gateway):
    """docs/contract.md, "Metrics": requests_total{endpoint,status,machine_profile}, request_latency_seconds{endpoint,
    machine_profile}, provisioning_responses_total{machine_profile}, workers{status}."""
    pools = (one_pool(EndpointConfig(url="a")), PoolConfig("gpu", "l4", (EndpointConfig(url="c"),)))
    gw = await make_gateway(pools=pools, setup=lambda fakes: setattr(fakes["c"], "down", True))

    def scrape(name: str, **labels: str) -> float:
        return metric_value(render_metrics()[0].decode(), name, **labels)

    before = (scrape("sie_gateway_requests_total", endpoint="chat", status="200", machine_profile="default"),
              scrape("sie_gateway_request_latency_seconds_count", endpoint="chat", machine_profile="default"),
              scrape("sie_gateway_provisioning_responses_total", machine_profile="l4"))
    assert (await gw.chat()).status_code == 200
    unreachable = await gw.chat(headers={"X-SIE-MACHINE-PROFILE": "l4"})
    assert unreachable.status_code == 503 and unreachable.headers["x-sie-error-code"] == "PROVISIONING"
    after = (scrape("sie_gateway_requests_total", endpoint="chat", status="200", machine_profile="default"),
             scrape("sie_gateway_request_latency_seconds_count", endpoint="chat", machine_profile="default"),
             scrape("sie_gateway_provisioning_responses_total", machine_profile="l4"))
    assert [b - a for a, b in zip(before, after, strict=True)] == [1, 1, 1]
    assert scrape("sie_gateway_requests_total", endpoint="chat", status="503", machine_profile="l4") >= 1
    workers = scrape("sie_gateway_workers", status="healthy"), scrape("sie_gateway_workers", status="unhealthy")
    assert workers == (1, 1)
