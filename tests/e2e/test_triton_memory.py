"""tritonserver stays up, and its memory flat, however many requests the gateway's client runs through it or
leaves early (a soak's needs, and clients that disconnect).

tritonserver 2.51 keeps about 9 kB for every `ModelStreamInfer` call that the client cancels, so a gateway that
ended each finished request's call with `cancel()` grew the server without bound (the 15-minute soak: 49 ->
140 MB, linear); with the old ending the first test sees +46 MB. Cancelling a call while the model still sends on
it also aborts the server now and then (a gRPC assertion, SIGABRT): the second test's streams, cancelled, took it
down within a few hundred. The client now ends every call itself: a finished request's by half-closing it, a
generation left early by a stop request on the call first (contract/stop_call.py).
"""

from __future__ import annotations

import asyncio
import contextlib

import psutil

from gateway.domain import GenerationRequest
from gateway.triton.client import TritonClient
from tests.e2e.conftest import StubStack

CONCURRENCY = 32


async def _run_requests(url: str, count: int) -> None:
    client = TritonClient(url)
    request = GenerationRequest(model="m", max_tokens=4, max_tokens_param="max_tokens", prompt="hi", stream=True)
    started = 0

    async def worker() -> None:
        nonlocal started
        while started < count:
            started += 1
            texts = [event.text async for event in client.generate("stub_tokens", request, f"mem-{started}")]
            assert "".join(texts) == "tok " * 4

    try:
        await asyncio.gather(*(worker() for _ in range(CONCURRENCY)))
    finally:
        await client.close()


async def _leave_streams_early(url: str, count: int) -> None:
    """Streams of 100,000 tokens, each left after its first two events, as a client that disconnects."""
    client = TritonClient(url)
    request = GenerationRequest(model="m", max_tokens=100_000, max_tokens_param="max_tokens", prompt="hi",
                                stream=True)
    started = 0

    async def worker() -> None:
        nonlocal started
        while started < count:
            started += 1
            async with contextlib.aclosing(client.generate("stub_tokens", request, f"left-{started}")) as events:
                assert [(await anext(events)).text for _ in range(2)] == ["tok ", "tok "]

    try:
        await asyncio.gather(*(worker() for _ in range(CONCURRENCY)))
    finally:
        await client.close()


def _rss_mb(pid: int) -> float:
    return psutil.Process(pid).memory_info().rss / 2**20  # the server process alone, not the model stubs


def test_finished_requests_leave_tritonserver_memory_flat(stub: StubStack):
    url = f"127.0.0.1:{stub.ports.grpc}"
    asyncio.run(_run_requests(url, 500))  # warm-up: thread pools, allocator arenas, gRPC buffers
    before = _rss_mb(stub.triton.pid)
    asyncio.run(_run_requests(url, 3000))
    grown = _rss_mb(stub.triton.pid) - before
    assert grown < 6.0, f"tritonserver grew {grown:.1f} MB over 3,000 finished requests"


def test_streams_left_early_leave_tritonserver_up_and_its_memory_flat(stub: StubStack):
    url = f"127.0.0.1:{stub.ports.grpc}"
    asyncio.run(_leave_streams_early(url, 300))
    before = _rss_mb(stub.triton.pid)
    asyncio.run(_leave_streams_early(url, 2000))
    assert stub.triton.poll() is None, "tritonserver died"
    grown = _rss_mb(stub.triton.pid) - before
    assert grown < 6.0, f"tritonserver grew {grown:.1f} MB over 2,000 streams left early"
