"""The gateway's gRPC keepalive pings must never make Triton drop the connection.

Triton (gRPC core) answers pings that arrive more often than every 5 minutes while no data flows with GOAWAY
`too_many_pings`, which kills every stream on the channel: a long blocking generation sends no data for
minutes. The local stack and the image start Triton with a permissive ping policy; this test pings faster
than the gateway does (gRPC core throttles a client's pings to a few a minute) over a stream that stays silent
for 12 s. Against Triton's default policy (measured with these pings) a silence of 6, 8, 12 or 25 s ends in GOAWAY
`too_many_pings` and 4 s does not, so the test fails without the permissive policy with room to spare.
"""

from __future__ import annotations

import asyncio

import grpc
from tritonclient.grpc import service_pb2_grpc

from gateway.domain import GenerationRequest
from gateway.triton.codec import decode_response, encode_request

AGGRESSIVE_PINGS = [
    ("grpc.keepalive_time_ms", 1000),
    ("grpc.keepalive_timeout_ms", 5000),
    ("grpc.keepalive_permit_without_calls", 1),
    ("grpc.http2.max_pings_without_data", 0),
]


async def _silent_stream_then_request(url: str) -> str:
    channel = grpc.aio.insecure_channel(url, options=AGGRESSIVE_PINGS)
    stub = service_pb2_grpc.GRPCInferenceServiceStub(channel)
    request = encode_request("stub_tokens", GenerationRequest(model="m", max_tokens=3, max_tokens_param="max_tokens",
                                                              prompt="Hi"), "keepalive-1")
    go = asyncio.Event()

    async def requests():
        await go.wait()  # the stream is open but carries no data while the pings go out
        yield request

    call = stub.ModelStreamInfer(requests())
    await asyncio.sleep(12.0)  # pings without data: past Triton's default of 2 strikes
    go.set()
    try:
        async for response in call:
            event, final = decode_response(response.infer_response)
            if final:
                return event.text
        return ""
    finally:
        call.cancel()
        await channel.close()


def test_frequent_keepalive_pings_on_a_silent_stream_are_tolerated(stub):
    text = asyncio.run(_silent_stream_then_request(f"127.0.0.1:{stub.ports.grpc}"))
    assert text == "tok tok tok "
