"""Per-request plumbing: request id, SIE headers on every response, auth before the body is read."""

from __future__ import annotations

import logging
import re
import uuid

import falcon

from gateway.auth import Authenticator
from gateway.settings import Settings

log = logging.getLogger("gateway.requests")
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
