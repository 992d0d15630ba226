"""Reading a JSON body under a size limit, without reading past it, from a client that keeps sending."""

from __future__ import annotations

import asyncio
from typing import Any

import orjson

from gateway import msgpack_body
from gateway.errors import InvalidRequest, PayloadTooLarge, RequestTimeout


async def read_json_body(req, limit: int, read_timeout_s: float, msgpack_ok: bool = False) -> Any:
    """Each read must bring data within `read_timeout_s` (nginx's `client_body_timeout`): a slow upload
    that keeps moving is fine, a stalled one gets 408 instead of holding its connection and buffer.

    With `msgpack_ok`, a `Content-Type: application/msgpack` body is decoded as msgpack (the native route)."""
    too_large = PayloadTooLarge(f"Request body too large (max {limit} bytes)")
    length = req.content_length
    if length is not None and length > limit:
        raise too_large
    chunks, total = [], 0
    pieces = aiter(req.stream)  # each body message as it arrives (`read(n)` would wait for n bytes)
    while True:
        try:
            async with asyncio.timeout(read_timeout_s):
                chunk = await anext(pieces)
        except StopAsyncIteration:
            break
        except TimeoutError:
            raise RequestTimeout(f"request body stalled: no data for {read_timeout_s:g} s") from None
        total += len(chunk)
        if total > limit:
            raise too_large
        chunks.append(chunk)
    raw = b"".join(chunks)
    if msgpack_ok and msgpack_body.is_msgpack(req.content_type):
        return msgpack_body.decode(raw)
    if not raw.strip():
        raise InvalidRequest("request body must be a JSON object")
    try:
        return orjson.loads(raw)
    except orjson.JSONDecodeError:
        raise InvalidRequest("request body is not valid JSON (UTF-8)") from None
