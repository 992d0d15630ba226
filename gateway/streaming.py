"""SSE driver shared by both contracts: framing, keep-alives, in-band errors, the single [DONE].

Status and headers are already sent when this runs (the first event arrived before the stream
opened), so any failure from here on becomes an error event followed by `data: [DONE]`. A client
disconnect cancels the model stream at once, even while waiting for the next token.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator
from typing import Any, Protocol

import orjson
from falcon.asgi import SSEvent

from gateway.domain import GenerationEvent
from gateway.errors import GatewayError

log = logging.getLogger(__name__)

DONE = SSEvent(data=b"[DONE]")
KEEPALIVE = SSEvent(comment="keep-alive")


class StreamRenderer(Protocol):
    def on_event(self, event: GenerationEvent) -> list[dict[str, Any]]: ...
    def usage_chunk(self) -> dict[str, Any] | None: ...
    def error_chunk(self, error: GatewayError) -> dict[str, Any]: ...


async def sse_events(
    events: AsyncIterator[GenerationEvent],
    renderer: StreamRenderer,
    keepalive_s: float,
    disconnected: asyncio.Event | None,
) -> AsyncIterator[SSEvent]:
    gone = asyncio.ensure_future(disconnected.wait()) if disconnected is not None else None
    pending: asyncio.Future | None = None
    try:
        while True:
            if pending is None:
                pending = asyncio.ensure_future(anext(events))
            waiters = {pending} if gone is None else {pending, gone}
            done, _ = await asyncio.wait(waiters, timeout=keepalive_s, return_when=asyncio.FIRST_COMPLETED)
            if gone is not None and gone in done:
                return  # client left: `finally` cancels the model stream
            if not done:
                yield KEEPALIVE
                continue
            future, pending = pending, None
            try:
                event = future.result()
            except StopAsyncIteration:
                break
            for chunk in renderer.on_event(event):
                yield SSEvent(data=orjson.dumps(chunk))
        usage = renderer.usage_chunk()
        if usage is not None:
            yield SSEvent(data=orjson.dumps(usage))
    except GatewayError as exc:
        yield SSEvent(data=orjson.dumps(renderer.error_chunk(exc)))
    except Exception:
        log.exception("stream failed")
        yield SSEvent(data=orjson.dumps(renderer.error_chunk(GatewayError("internal error while streaming"))))
    finally:
        if gone is not None:
            gone.cancel()
        if pending is not None:
            # the model stream is mid-`anext`: let the cancellation unwind it before closing it,
            # else `aclose()` finds the generator still running and the Triton call leaks
            pending.cancel()
            await asyncio.gather(pending, return_exceptions=True)
        await events.aclose()
    yield DONE
