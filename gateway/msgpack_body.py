"""msgpack on the native generate route (docs/contract.md, "Request headers": the SDK's client default content type is
msgpack, and the gateway answers msgpack to a msgpack Accept). A msgpack body must decode to what JSON could carry:
string keys, and strings, numbers, booleans, null, arrays and maps as values, so the contract checks after it are
the JSON ones."""

from __future__ import annotations

import math
from typing import Any

import msgpack

from gateway.errors import InvalidRequest

MSGPACK_TYPES = ("application/msgpack", "application/x-msgpack", "application/vnd.msgpack")
_SCALARS = (str, int, bool, type(None))


def is_msgpack(content_type: str | None) -> bool:
    return (content_type or "").split(";", 1)[0].strip().lower() in MSGPACK_TYPES


def decode(raw: bytes) -> Any:
    try:
        # ext types (timestamps included) are not JSON: refused, like any other non-JSON value below
        body = msgpack.unpackb(raw, raw=False, strict_map_key=True, timestamp=0, ext_hook=_no_ext)
    except (ValueError, msgpack.UnpackException, TypeError):
        raise InvalidRequest("request body is not valid msgpack") from None
    _check_json_like(body)
    return body


def encode(body: Any) -> bytes:
    return msgpack.packb(body, use_bin_type=True)


def _no_ext(code: int, data: bytes) -> Any:
    raise ValueError(f"msgpack extension type {code}")


def _check_json_like(body: Any) -> None:
    """Iterative (a nested body cannot exhaust the stack): every key a string, every value JSON-representable."""
    stack = [body]
    while stack:
        value = stack.pop()
        if isinstance(value, dict):
            if not all(isinstance(key, str) for key in value):
                raise InvalidRequest("request body must have string keys only")
            stack.extend(value.values())
        elif isinstance(value, list):
            stack.extend(value)
        elif isinstance(value, float):
            if not math.isfinite(value):
                raise InvalidRequest("request body must not hold NaN or infinite numbers")
        elif not isinstance(value, _SCALARS):
            raise InvalidRequest(f"request body holds a {type(value).__name__} value; send JSON types only "
                                 "(binary data as base64 strings)")
