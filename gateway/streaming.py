"""SSE driver shared by the contracts: framing, keep-alives, in-band errors, the single [DONE].

Status and headers are already sent when this runs (the first event arrived before the stream
opened), so any failure from here on becomes an error event followed by `data: [DONE]`.

Hot path: a pump task reads the model stream into a bounded buffer; the writer drains whatever is
queued and sends it as one body chunk, so a burst of tokens costs one socket write, not one per token.
A slow reader makes the buffer fold deltas together instead of growing (`stream_buffer.py`).
A client disconnect cancels the pump (and so the Triton request) at once, even mid-silence.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable, Callable
from typing import Any, Protocol

import orjson

from gateway.domain import GenerationEvent
from gateway.errors import GatewayError
from gateway.metrics import ERRORS
from gateway.stream_buffer import StreamBuffer

log = logging.getLogger(__name__)

DONE = b"data: [DONE]\n\n"
KEEPALIVE = b": keep-alive\n\n"
_END = object()  # the model stream finished
_GONE = object()  # the client disconnected


class StreamRenderer(Protocol):
    def on_event(self, event: GenerationEvent) -> list[dict[str, Any]]: ...
    def usage_chunk(self) -> dict[str, Any] | None: ...
    def error_chunk(self, error: GatewayError) -> dict[str, Any]: ...


def frame(chunk: dict[str, Any]) -> bytes:
    return b"data: " + orjson.dumps(chunk) + b"\n\n"


def named_frame(chunk: dict[str, Any]) -> bytes:
    """The Responses API's framing: an `event:` line naming the payload's `type`, then its data."""
    return b"event: " + chunk["type"].encode() + b"\n" + frame(chunk)


async def _pump(events: AsyncGenerator[GenerationEvent, None], buffer: StreamBuffer) -> None:
    try:
        async for event in events:
            if event.is_progress:
                continue  # liveness only (a preempted request's heartbeat, docs/kv-memory.md): nothing to send
            await buffer.put(event)
        buffer.put_terminal(_END)
    except asyncio.CancelledError:
        task = asyncio.current_task()
        if task is None or task.cancelling():
            raise  # the writer or the disconnect watcher stopped us: nobody waits for an end
        # the model stream itself ended with CANCELLED (gRPC status from Triton): the client still
        # gets an error event and its [DONE] instead of keep-alives forever
        buffer.put_terminal(GatewayError("the model server cancelled the request", code="cancelled", status=408))
    except GatewayError as exc:
        buffer.put_terminal(exc)
    except Exception as exc:
        log.exception("stream failed")
        buffer.put_terminal(GatewayError(f"internal error while streaming ({type(exc).__name__})"))


async def sse_stream(
    events: AsyncGenerator[GenerationEvent, None],
    renderer: StreamRenderer,
    keepalive_s: float,
    watch_disconnect: Callable[[], Awaitable[None]] | None,
    buffer_events: int = 64,
    *,
    named_events: bool = False,
) -> AsyncIterator[bytes]:
    """`named_events`: Responses framing (`event:` lines, and no `[DONE]`: its terminal event ends it)."""
    framer = named_frame if named_events else frame
    done = b"" if named_events else DONE
    queue = StreamBuffer(buffer_events)
    pump = asyncio.create_task(_pump(events, queue))
    watcher = None
    if watch_disconnect is not None:
        async def on_disconnect() -> None:
            await watch_disconnect()
            pump.cancel()
            queue.put_terminal(_GONE)

        watcher = asyncio.create_task(on_disconnect())
    try:
        while True:
            try:
                async with asyncio.timeout(keepalive_s):
                    item = await queue.get()
            except TimeoutError:
                yield KEEPALIVE
                continue
            parts: list[bytes] = []
            finished = False
            while True:
                if item is _GONE:
                    return  # nobody is reading; `finally` has cancelled the model stream
                if item is _END:
                    usage = renderer.usage_chunk()
                    if usage is not None:
                        parts.append(framer(usage))
                    finished = True
                elif isinstance(item, GatewayError):
                    ERRORS.labels(code=item.code, status=200).inc()  # in-band: the stream had opened with 200
                    parts.append(framer(renderer.error_chunk(item)))
                    finished = True
                else:
                    parts.extend(framer(chunk) for chunk in renderer.on_event(item))
                if finished or queue.empty():
                    break
                item = queue.get_nowait()
            if finished:
                parts.append(done)
                yield b"".join(parts)
                return
            if parts:
                yield b"".join(parts)
    finally:
        pump.cancel()
        if watcher is not None:
            watcher.cancel()
        await asyncio.gather(pump, return_exceptions=True)
        await events.aclose()
