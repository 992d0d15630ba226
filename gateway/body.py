"""Reading a JSON body under a size limit, without reading past it."""

from __future__ import annotations

from typing import Any

import orjson

from gateway.errors import InvalidRequest, PayloadTooLarge

_CHUNK = 64 * 1024


async def read_json_body(req, limit: int) -> Any:
    too_large = PayloadTooLarge(f"Request body too large (max {limit} bytes)")
    length = req.content_length
    if length is not None and length > limit:
        raise too_large
    chunks, total = [], 0
    while True:
        chunk = await req.stream.read(_CHUNK)
        if not chunk:
            break
        total += len(chunk)
        if total > limit:
            raise too_large
        chunks.append(chunk)
    raw = b"".join(chunks)
    if not raw.strip():
        raise InvalidRequest("request body must be a JSON object")
    try:
        return orjson.loads(raw)
    except orjson.JSONDecodeError:
        raise InvalidRequest("request body is not valid JSON (UTF-8)") from None
