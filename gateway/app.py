"""App factory: wires settings, registry, service, resources and the error envelope."""

from __future__ import annotations

import logging
import time
from collections.abc import AsyncIterator, Callable
from typing import Any

import falcon
import falcon.asgi
import orjson

from gateway.auth import Authenticator
from gateway.disconnect import DisconnectAware
from gateway.drain import Drain
from gateway.errors import GatewayError
from gateway.metrics import ERRORS, IN_FLIGHT, LATENCY, PROVISIONING, REQUESTS
from gateway.middleware import RequestContextMiddleware, route_name
from gateway.openapi_doc import build_openapi
from gateway.registry import ModelRegistry
from gateway.resources.chat import ChatCompletionsResource
from gateway.resources.cluster_status import ClusterStatusFeed
from gateway.resources.completions import CompletionsResource
from gateway.resources.docs import DocsResource, IndexResource, RedocScriptResource
from gateway.resources.generate import GenerateResource
from gateway.resources.health import (
    GatewayHealthResource,
    HealthResource,
    MetricsResource,
    OpenAPIResource,
    ReadyResource,
    VersionResource,
)
from gateway.resources.lora import LoraAdapterResource
from gateway.resources.models import ModelsResource
from gateway.resources.responses import ResponsesResource, StoredResponseResource
from gateway.resources.tokenize import DetokenizeResource, TokenizeResource
from gateway.responses_store import open_store
from gateway.service import GenerationService
from gateway.settings import Settings

log = logging.getLogger(__name__)
access_log = logging.getLogger("gateway.access")

def _write_error(req, resp, error: GatewayError) -> None:
    ERRORS.labels(code=error.code, status=error.status).inc()
    resp.status = error.status
    resp.content_type = "application/json"
    resp.data = orjson.dumps(error.body())
    for name, value in error.headers().items():
        resp.set_header(name, value)


async def _gateway_error(req, resp, ex: GatewayError, params) -> None:
    _write_error(req, resp, ex)


async def _http_error(req, resp, ex: falcon.HTTPError, params) -> None:
    status = ex.status_code
    error = GatewayError(ex.title or "error", code="invalid_request" if status < 500 else "inference_error",
                         status=status)
    error.type = "invalid_request_error" if status < 500 else "server_error"
    _write_error(req, resp, error)
    resp.set_headers(ex.headers or {})


async def _unexpected(req, resp, ex: Exception, params) -> None:
    log.exception("unhandled error on %s (request %s)", req.path, getattr(req.context, "request_id", "?"))
    _write_error(req, resp, GatewayError("internal server error"))


class _Observe:
    """Request counters, the in-flight gauge, latency to the last byte and one structured log line per request.

    A streamed body (`resp.stream`, which Falcon consumes after the responder and this hook have returned) is
    still in flight until its last chunk is out or the client has gone: for it the gauge, the latency and the
    log line close when the body ends, not when the headers are sent. The status counter still counts at the
    response start (a stream's status is the 200 it opened with)."""

    async def process_request(self, req, resp) -> None:
        req.context.started = time.perf_counter()
        IN_FLIGHT.labels(endpoint=route_name(req.path)).inc()

    async def process_response(self, req, resp, resource, req_succeeded) -> None:
        route = route_name(req.path)
        model = getattr(req.context, "model", "") or ""
        status = resp.status_code
        profile = req.context.get("machine_profile", "")
        REQUESTS.labels(endpoint=route, status=status, machine_profile=profile, model=model).inc()
        if status == 503 and resp.get_header("X-SIE-Error-Code") == "PROVISIONING":
            PROVISIONING.labels(machine_profile=profile).inc()
        if _streams_body(req, resp):
            resp.stream = _BodyEnd(resp.stream, lambda: _finish(req, route, profile, model, status))
        else:
            _finish(req, route, profile, model, status)


def _finish(req, route: str, profile: str, model: str, status: int) -> None:
    IN_FLIGHT.labels(endpoint=route).dec()
    elapsed = time.perf_counter() - req.context.started
    if route != "other":
        LATENCY.labels(endpoint=route, machine_profile=profile, model=model).observe(elapsed)
        access_log.info("request", extra={"request_id": getattr(req.context, "request_id", None),
                                          "route": route, "status": status, "model": model,
                                          "ms": round(elapsed * 1000, 3)})


def _streams_body(req, resp) -> bool:
    """Whether Falcon will iterate `resp.stream` after the middleware (it ignores it when `data`, `text` or
    `media` is set, for HEAD and for bodiless statuses, and for SSE through `resp.sse`)."""
    return (hasattr(resp.stream, "__anext__") and resp.text is None and resp.data is None and resp.media is None
            and resp.sse is None and req.method != "HEAD" and resp.status_code >= 200
            and resp.status_code not in (204, 304))


class _BodyEnd:
    """`resp.stream` seen through: calls `ended` once, when the body is over: its last chunk sent (the next
    `__anext__` ends it), or a failure, or Falcon's `close()` after the body (which it always calls, also when a
    send failed or the task was cancelled). `close()` first closes the wrapped generator, so its cleanup (the
    Triton cancel after a disconnect) is inside the measured time."""

    __slots__ = ("_body", "_ended")

    def __init__(self, body: AsyncIterator[bytes], ended: Callable[[], None]) -> None:
        self._body = body
        self._ended: Callable[[], None] | None = ended

    def __aiter__(self) -> _BodyEnd:
        return self

    async def __anext__(self) -> bytes:
        try:
            return await self._body.__anext__()
        except BaseException:
            self._end()
            raise

    async def close(self) -> None:
        try:
            aclose = getattr(self._body, "aclose", None)
            if aclose is not None:
                await aclose()
        finally:
            self._end()

    def _end(self) -> None:
        ended, self._ended = self._ended, None
        if ended is not None:
            ended()

    def __del__(self) -> None:
        # a response that failed before its body was read (its start could not be sent) still leaves the gauge
        self._end()


def create_app(settings: Settings, registry: ModelRegistry | None = None, drain: Drain | None = None,
               auth: Authenticator | None = None) -> falcon.asgi.App:
    registry = registry or ModelRegistry(settings)
    drain = drain or Drain()
    service = GenerationService(settings, registry, drain)
    middleware: list[Any] = [_Observe(), RequestContextMiddleware(settings, auth)]
    app = falcon.asgi.App(middleware=middleware)
    app.req_options.strip_url_path_trailing_slash = True
    app.add_route("/v1/chat/completions", ChatCompletionsResource(settings, service))
    app.add_route("/v1/completions", CompletionsResource(settings, service))
    store = open_store(settings.responses_store, max_rows=settings.responses_store_max_rows,
                       max_bytes=settings.responses_store_max_bytes, ttl_s=settings.responses_store_ttl_s)
    app.add_route("/v1/responses", ResponsesResource(settings, service, store))
    app.add_route("/v1/responses/{response_id}", StoredResponseResource(store))
    generate = GenerateResource(settings, service)
    app.add_route("/v1/generate/{model}", generate)
    app.add_sink(_generate_sink(generate), prefix=r"^/v1/generate(/|$)")  # `/v1/generate/` loses its slash
    app.add_route("/healthz", HealthResource())
    app.add_route("/readyz", ReadyResource(registry, drain))
    app.add_route("/health", GatewayHealthResource(registry))
    app.add_route("/version", VersionResource(settings.server_version))
    app.add_route("/tokenize", TokenizeResource(settings, service))
    app.add_route("/detokenize", DetokenizeResource(settings, service))
    models = ModelsResource(registry)
    app.add_route("/v1/models", models)
    app.add_sink(models.retrieve, prefix=r"^/v1/models/")
    app.add_route("/v1/load_lora_adapter", LoraAdapterResource(settings, registry, "load"))
    app.add_route("/v1/unload_lora_adapter", LoraAdapterResource(settings, registry, "unload"))
    app.add_route("/metrics", MetricsResource(settings.engine_metrics_url, registry))
    openapi = build_openapi()
    app.add_route("/openapi.json", OpenAPIResource(openapi))
    app.add_route("/docs", DocsResource(openapi))
    app.add_route("/docs/redoc.standalone.js", RedocScriptResource())
    app.add_route("/", IndexResource(settings.server_version))
    app.add_error_handler(Exception, _unexpected)
    app.add_error_handler(falcon.HTTPError, _http_error)
    app.add_error_handler(GatewayError, _gateway_error)

    async def startup() -> None:
        registry.start()

    async def shutdown() -> None:
        await registry.stop()
        if store is not None:
            store.close()

    app.add_middleware(_Lifespan(startup, shutdown))
    return app


def _generate_sink(resource: GenerateResource):
    """The path is a catch-all: `/v1/generate/a/b` and empty ids must reach the resource's 400s."""

    async def sink(req, resp, **_: str) -> None:
        if req.method != "POST":
            raise falcon.HTTPMethodNotAllowed(["POST"])
        await resource.on_post(req, resp)

    return sink


class _Lifespan:
    def __init__(self, startup, shutdown) -> None:
        self._startup, self._shutdown = startup, shutdown

    async def process_startup(self, scope, event) -> None:
        await self._startup()

    async def process_shutdown(self, scope, event) -> None:
        await self._shutdown()


class _Served:
    """The served ASGI callable: WebSocket handshakes go to the status feed, HTTP and lifespan to the Falcon app
    behind the disconnect tracker (the app's lifespan starts the registry both read).

    Its `drain` is what the worker's SIGTERM handler starts, its `auth` what SIGHUP tells to re-read the keys
    file (gateway/worker.py); uvicorn itself closes open WebSockets (1012) when the worker stops."""

    def __init__(self, http, websocket: ClusterStatusFeed, drain: Drain, auth: Authenticator) -> None:
        self.http, self.websocket, self.drain, self.auth = http, websocket, drain, auth

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] == "websocket":
            await self.websocket(scope, receive, send)
        else:
            await self.http(scope, receive, send)


def create_asgi(settings: Settings | None = None) -> _Served:
    settings = settings or Settings.from_env()
    drain, registry, auth = Drain(), ModelRegistry(settings), Authenticator(settings)
    http = DisconnectAware(create_app(settings, registry, drain, auth))
    feed = ClusterStatusFeed(registry, auth, server_version=settings.server_version)
    return _Served(http, feed, drain, auth)



