"""Per-request plumbing: request id, SIE headers on every response, auth before the body is read, the request
metrics and access log (held open until a streamed body ends), and the app's lifespan hooks."""

from __future__ import annotations

import logging
import re
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable

import falcon

from gateway.auth import Authenticator
from gateway.metrics import IN_FLIGHT, LATENCY, PROVISIONING, REQUESTS
from gateway.settings import Settings

log = logging.getLogger("gateway.requests")
access_log = logging.getLogger("gateway.access")
_SDK_VERSION = re.compile(r"^(\d+)\.(\d+)")
_ROUTE_NAMES = {"/v1/chat/completions": "chat", "/v1/completions": "completions", "/v1/responses": "responses"}


def route_name(path: str) -> str:
    """The inference route a path is ("chat", "completions", "responses", "generate"), else "other"."""
    return "generate" if path.startswith("/v1/generate/") else _ROUTE_NAMES.get(path, "other")


class RequestContextMiddleware:
    def __init__(self, settings: Settings, auth: Authenticator | None = None) -> None:
        self.settings = settings
        self.auth = auth or Authenticator(settings)
        self._warned_versions: set[str] = set()

    async def process_request(self, req, resp) -> None:
        req.context.request_id = uuid.uuid4().hex
        resp.set_header("X-SIE-Request-ID", req.context.request_id)
        resp.set_header("X-SIE-Server-Version", self.settings.server_version)
        resp.set_header("X-SIE-Version", self.settings.server_version)
        self._check_sdk_version(req.get_header("X-SIE-SDK-Version"))
        # the tenant scopes stored responses and the prefix cache (docs/auth.md)
        req.context.tenant = self.auth.check(req.path, req.get_header("Authorization"), req.get_header("x-api-key"))

    async def process_response(self, req, resp, resource, req_succeeded) -> None:
        """`X-SIE-Served-By` on inference answers, 2xx and 5xx only (a 4xx is the client's, served by nobody):
        `local` unless the request ran on an endpoint configured as remote; `X-SIE-Model-Revision` on buffered
        2xx answers (both recorded by resources/common.record_answering_endpoint)."""
        if req.method != "POST" or route_name(req.path) == "other":
            return
        status = falcon.http_status_to_code(resp.status)
        if status // 100 in (2, 5):
            resp.set_header("X-SIE-Served-By", req.context.get("served_by", "local"))
        revision = req.context.get("model_revision")
        # buffered answers only: an SSE stream's headers go out before the answer is known (docs/contract.md, "Response
        # headers")
        if status // 100 == 2 and revision and resp.content_type != "text/event-stream":
            resp.set_header("X-SIE-Model-Revision", revision)

    def _check_sdk_version(self, version: str | None) -> None:
        """Skew is advisory: log once per distinct version (bounded), never reject."""
        if not version or version in self._warned_versions or len(self._warned_versions) >= 64:
            return
        self._warned_versions.add(version)
        ours, theirs = _SDK_VERSION.match(self.settings.server_version), _SDK_VERSION.match(version)
        if theirs is None or ours is None or ours.groups()[0] != theirs.groups()[0] or \
                abs(int(ours.groups()[1]) - int(theirs.groups()[1])) > 1:
            log.warning("client SDK version %s differs from gateway contract version %s",
                        version[:32], self.settings.server_version)


class ObserveRequests:
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
        if streams_body(req, resp):
            resp.stream = BodyEnd(resp.stream, lambda: _finish(req, route, profile, model, status))
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


def streams_body(req, resp) -> bool:
    """Whether Falcon will iterate `resp.stream` after the middleware (it ignores it when `data`, `text` or
    `media` is set, for HEAD and for bodiless statuses, and for SSE through `resp.sse`)."""
    return (hasattr(resp.stream, "__anext__") and resp.text is None and resp.data is None and resp.media is None
            and resp.sse is None and req.method != "HEAD" and resp.status_code >= 200
            and resp.status_code not in (204, 304))


class BodyEnd:
    """`resp.stream` seen through: calls `ended` once, when the body is over: its last chunk sent (the next
    `__anext__` ends it), or a failure, or Falcon's `close()` after the body (which it always calls, also when a
    send failed or the task was cancelled). `close()` first closes the wrapped generator, so its cleanup (the
    Triton cancel after a disconnect) is inside the measured time."""

    __slots__ = ("_body", "_ended")

    def __init__(self, body: AsyncIterator[bytes], ended: Callable[[], None]) -> None:
        self._body = body
        self._ended: Callable[[], None] | None = ended

    def __aiter__(self) -> BodyEnd:
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

    # a BodyEnd may wrap another (admission's slot inside the request metrics): the outer one closes the inner
    aclose = close

    def _end(self) -> None:
        ended, self._ended = self._ended, None
        if ended is not None:
            ended()

    def __del__(self) -> None:
        # a response that failed before its body was read (its start could not be sent) still leaves the gauge
        self._end()


class Lifespan:
    """Runs the app's startup and shutdown (the ASGI lifespan): the background tasks start and stop with it."""

    def __init__(self, startup: Callable[[], Awaitable[None]], shutdown: Callable[[], Awaitable[None]]) -> None:
        self._startup, self._shutdown = startup, shutdown

    async def process_startup(self, scope, event) -> None:
        await self._startup()

    async def process_shutdown(self, scope, event) -> None:
        await self._shutdown()
