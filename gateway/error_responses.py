"""The one place an error becomes an HTTP answer: the contract's envelope, status, headers and the error counter.

Falcon calls these (gateway/app.py registers them); handlers and services only raise."""

from __future__ import annotations

import logging

import falcon
import orjson

from gateway.errors import GatewayError
from gateway.metrics import ERRORS

log = logging.getLogger(__name__)


def _write_error(req, resp, error: GatewayError) -> None:
    ERRORS.labels(code=error.code, status=error.status).inc()
    resp.status = error.status
    resp.content_type = "application/json"
    resp.data = orjson.dumps(error.body())
    for name, value in error.headers().items():
        resp.set_header(name, value)


async def gateway_error(req, resp, ex: GatewayError, params) -> None:
    _write_error(req, resp, ex)


async def http_error(req, resp, ex: falcon.HTTPError, params) -> None:
    status = ex.status_code
    error = GatewayError(ex.title or "error", code="invalid_request" if status < 500 else "inference_error",
                         status=status)
    error.type = "invalid_request_error" if status < 500 else "server_error"
    _write_error(req, resp, error)
    resp.set_headers(ex.headers or {})


async def unexpected_error(req, resp, ex: Exception, params) -> None:
    log.exception("unhandled error on %s (request %s)", req.path, getattr(req.context, "request_id", "?"))
    _write_error(req, resp, GatewayError("internal server error"))
