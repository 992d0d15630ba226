"""Gateway overhead, measured side by side in one run. Prints these lines last:

gateway_added_p50_ms / gateway_added_p99_ms: a non-streamed request through the gateway minus the
same request sent directly to Triton over gRPC (stub model, no torch: only transport is measured).
stream_ratio_c8 / gateway_chunks_per_s_c8: SSE chunks/s through the gateway over chunks/s read
directly from Triton's gRPC stream, 8 concurrent clients. e2e_ratio_c8: the real model, gateway +
Triton tok/s over the in-process engine, 8 concurrent.
"""

from __future__ import annotations

import asyncio
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import grpc
from tritonclient.grpc import service_pb2, service_pb2_grpc

from devstack.stack import local_stack
from devstack.triton import REPO_ROOT, TritonPorts
from gateway.domain import GenerationRequest
from gateway.triton.codec import encode_request

STUB_REPO = REPO_ROOT / "tests" / "stub_repository"
STUB_SIE_ID = "sie-test__stub-tokens"
SAMPLES = 300
STREAM_TOKENS = 2000
CLIENTS = 8


def _percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


async def _direct_once(stub, req: GenerationRequest, model: str) -> int:
    done = asyncio.Event()

    async def requests():
        yield encode_request(model, req, "bench")
        await done.wait()

    call = stub.ModelStreamInfer(requests())
    chunks = 0
    async for response in call:
        chunks += 1
        final = dict(zip((o.name for o in response.infer_response.outputs),
                         response.infer_response.raw_output_contents, strict=False)).get("is_final")
        if final == b"\x01" or response.error_message:
            break
    done.set()  # half-close, then read the call to its end, as the gateway does (gateway/triton/client.py)
    async for _ in call:
        pass
    return chunks


async def _http_once(host: str, port: int, path: str, body: bytes, count_chunks: bool) -> int:
    """Minimal HTTP/1.1 client: one request per connection; counts SSE `data:` events."""
    reader, writer = await asyncio.open_connection(host, port)
    writer.write(b"POST " + path.encode() + b" HTTP/1.1\r\nHost: bench\r\nContent-Type: application/json\r\n"
                 b"Content-Length: " + str(len(body)).encode() + b"\r\nConnection: close\r\n\r\n" + body)
    await writer.drain()
    chunks = 0
    tail = b""
    while True:
        data = await reader.read(65536)
        if not data:
            break
        if count_chunks:
            window = tail + data
            chunks += window.count(b"data: ")
            tail = window[-8:]
    writer.close()
    return chunks


class _KeepAliveClient:
    """One persistent HTTP/1.1 connection (as the gRPC side keeps one channel): request, then read the
    headers and exactly Content-Length bytes."""

    def __init__(self, port: int) -> None:
        self.port = port
        self.reader: asyncio.StreamReader | None = None
        self.writer: asyncio.StreamWriter | None = None

    async def post(self, path: str, body: bytes) -> bytes:
        if self.writer is None:
            self.reader, self.writer = await asyncio.open_connection("127.0.0.1", self.port)
        assert self.reader is not None
        self.writer.write(b"POST " + path.encode() + b" HTTP/1.1\r\nHost: bench\r\nContent-Type: application/json\r\n"
                          b"Content-Length: " + str(len(body)).encode() + b"\r\n\r\n" + body)
        head = await self.reader.readuntil(b"\r\n\r\n")
        length = 0
        for line in head.split(b"\r\n"):
            if line.lower().startswith(b"content-length:"):
                length = int(line.split(b":", 1)[1])
        return await self.reader.readexactly(length)

    def close(self) -> None:
        if self.writer is not None:
            self.writer.close()


async def _added_latency(stub, gw_port: int) -> tuple[float, float]:
    req = GenerationRequest(model="x", max_tokens=1, max_tokens_param="max_new_tokens", prompt="hi")
    body = json.dumps({"prompt": "hi", "max_new_tokens": 1}).encode()
    path = f"/v1/generate/{STUB_SIE_ID}"
    direct, through = [], []
    client = _KeepAliveClient(gw_port)
    for _ in range(20):  # warm-up
        await _direct_once(stub, req, "stub_tokens")
        await client.post(path, body)
    for _ in range(SAMPLES):
        t0 = time.perf_counter()
        await _direct_once(stub, req, "stub_tokens")
        t1 = time.perf_counter()
        await client.post(path, body)
        t2 = time.perf_counter()
        direct.append((t1 - t0) * 1000)
        through.append((t2 - t1) * 1000)
    client.close()
    p50 = statistics.median(through) - statistics.median(direct)
    p99 = _percentile(through, 0.99) - _percentile(direct, 0.99)
    print(f"direct_p50_ms: {statistics.median(direct):.3f}  gateway_p50_ms: {statistics.median(through):.3f}")
    return p50, p99


async def _stream_rates(stub, gw_port: int) -> tuple[float, float]:
    req = GenerationRequest(model="x", max_tokens=STREAM_TOKENS, max_tokens_param="max_new_tokens",
                            prompt="hi", stream=True)
    body = json.dumps({"prompt": "hi", "max_new_tokens": STREAM_TOKENS, "stream": True}).encode()
    path = f"/v1/generate/{STUB_SIE_ID}"
    t0 = time.perf_counter()
    direct = sum(await asyncio.gather(*(_direct_once(stub, req, "stub_tokens") for _ in range(CLIENTS))))
    direct_rate = direct / (time.perf_counter() - t0)
    t0 = time.perf_counter()
    through = sum(await asyncio.gather(*(_http_once("127.0.0.1", gw_port, path, body, True)
                                         for _ in range(CLIENTS))))
    gateway_rate = through / (time.perf_counter() - t0)
    print(f"direct_chunks_per_s_c8: {direct_rate:.0f}")
    return gateway_rate / direct_rate, gateway_rate


def _engine_tok_s(prompts: list[str], max_tokens: int) -> float:
    from engine.llm_engine import EngineConfig, LLMEngine
    from engine.sampling_params import SamplingParams

    engine = LLMEngine(EngineConfig(str(REPO_ROOT / ".cache/models/SmolLM2-135M-Instruct"), max_slots=16,
                                    max_len=512))
    engine.start()
    try:
        def run() -> float:
            params = [SamplingParams(max_tokens=max_tokens, temperature=0) for _ in prompts]
            ids = [engine.encode_prompt(messages=[{"role": "user", "content": p}], params=q)
                   for p, q in zip(prompts, params, strict=True)]
            t0 = time.perf_counter()
            queues = [engine.generate(str(i), x, q) for i, (x, q) in enumerate(zip(ids, params, strict=True))]
            tokens = 0
            for q in queues:
                while True:
                    out = q.get(timeout=300)
                    if out.finish_reason is not None:
                        tokens += out.completion_tokens
                    if out.final:
                        break
            return tokens / (time.perf_counter() - t0)
        run()
        return statistics.median(run() for _ in range(3))
    finally:
        engine.stop()


async def _gateway_tok_s(port: int, prompts: list[str], max_tokens: int) -> float:
    import httpx

    async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}", timeout=300) as client:
        async def one(prompt: str) -> int:
            r = await client.post("/v1/chat/completions", json={
                "model": "HuggingFaceTB/SmolLM2-135M-Instruct", "max_tokens": max_tokens, "temperature": 0,
                "messages": [{"role": "user", "content": prompt}]})
            return r.json()["usage"]["completion_tokens"]

        async def run() -> float:
            t0 = time.perf_counter()
            tokens = sum(await asyncio.gather(*(one(p) for p in prompts)))
            return tokens / (time.perf_counter() - t0)
        await run()
        return statistics.median([await run() for _ in range(3)])


def _with_stack(repo: Path, fn):
    with local_stack(repo, Path(tempfile.mkdtemp(prefix="bench-"))) as running:
        return fn(running.triton_ports, running.gateway_port)


def main() -> None:
    def transport(ports: TritonPorts, gw_port: int):
        async def go():
            channel = grpc.aio.insecure_channel(f"127.0.0.1:{ports.grpc}")
            stub = service_pb2_grpc.GRPCInferenceServiceStub(channel)
            added = await _added_latency(stub, gw_port)
            rates = await _stream_rates(stub, gw_port)
            await channel.close()
            return added, rates
        return asyncio.run(go())

    (p50, p99), (ratio, gw_rate) = _with_stack(STUB_REPO, transport)
    prompts = [f"Write one sentence about the number {i}." for i in range(CLIENTS)]
    max_tokens = 48
    gw_tok_s = _with_stack(REPO_ROOT / "model_repository",
                           lambda ports, port: asyncio.run(_gateway_tok_s(port, prompts, max_tokens)))
    engine_tok_s = _engine_tok_s(prompts, max_tokens)
    print(f"gateway_tok_s_c8: {gw_tok_s:.1f}  engine_tok_s_c8: {engine_tok_s:.1f}")
    print(f"gateway_added_p50_ms: {p50:.3f}")
    print(f"gateway_added_p99_ms: {p99:.3f}")
    print(f"stream_ratio_c8: {ratio:.3f}")
    print(f"gateway_chunks_per_s_c8: {gw_rate:.0f}")
    print(f"e2e_ratio_c8: {gw_tok_s / engine_tok_s:.3f}")
    sys.stdout.flush()


_ = service_pb2  # the request type travels through encode_request

if __name__ == "__main__":
    main()
