"""POST /v1/generate/{model} (SIE-native)."""

from __future__ import annotations

import urllib.parse

import falcon
import orjson

from gateway import msgpack_body
from gateway.admission import admit
from gateway.body import read_json_body
from gateway.contracts.generate import parse_generate_request
from gateway.errors import InvalidRequest, WorkerError, quoted, worker_error
from gateway.metrics import TTFT
from gateway.msgpack_body import MSGPACK_TYPES
from gateway.render.generate import GenerateStreamRenderer, render_generate_response
from gateway.resources.common import (
    collect_or_cancel,
    record_answering_endpoint,
    remote_forbidden,
    routing_hints,
    set_sse_headers,
    with_affinity,
)
from gateway.service import GenerationService
from gateway.settings import Settings
from gateway.streaming import sse_stream

PREFIX = "/v1/generate/"


def model_from_path(req) -> str:
    """The catch-all path segment, percent-decoded; slashes (also %2F) are not SIE-safe."""
    raw_path = req.scope.get("raw_path")
    raw = raw_path.decode("latin-1") if raw_path else req.path
    raw = raw.split("?", 1)[0]
    segment = raw[len(PREFIX):] if raw.startswith(PREFIX) else ""
    try:
        model = urllib.parse.unquote(segment, errors="strict")
    except UnicodeDecodeError:
        raise InvalidRequest("model path is not valid percent-encoded UTF-8", param="model") from None
    if not model:
        raise InvalidRequest("model path is empty", param="model")
    if "/" in model:
        safe = model.replace("/", "__")
        raise InvalidRequest(
            f"model id {quoted(model)} contains '/'; use the SIE-safe id {quoted(safe)} in the path", param="model"
        )
    return model


class GenerateResource:
    def __init__(self, settings: Settings, service: GenerationService) -> None:
        self.settings = settings
        self.service = service

    async def sink(self, req, resp, **_: str) -> None:
        """The path is a catch-all: `/v1/generate/a/b` and empty ids must reach `on_post`'s 400s."""
        if req.method != "POST":
            raise falcon.HTTPMethodNotAllowed(["POST"])
        await self.on_post(req, resp)

    async def on_post(self, req, resp, **_: str) -> None:
        # the contract's order: the path model (400 / 404) and the routing headers before the body
        model = model_from_path(req)
        profile, machine_profile = await self.service.lookup(model, forbid_remote=remote_forbidden(req))
        req.context.model = profile.name
        hints = routing_hints(req, None, machine_profile)
        self.service.router.check_pool(hints)
        body = await read_json_body(req, self.settings.generate_body_limit, self.settings.body_read_timeout_s,
                                    msgpack_ok=True)
        greq = admit(req, self.service.apply_profile(parse_generate_request(body, model), profile))
        hints = with_affinity(hints, greq)
        request_id = req.context.request_id
        session = await collect_or_cancel(self.service.open(greq, profile, hints, request_id), req)
        record_answering_endpoint(req, session)
        TTFT.labels(endpoint="generate", model=profile.name).observe(session.ttft_s)
        if greq.stream:
            set_sse_headers(resp)
            renderer = GenerateStreamRenderer(greq, request_id, session.ttft_s * 1000)
            resp.stream = sse_stream(session.events(), renderer, self.settings.keepalive_interval_s,
                                     req.scope.get("sie.watch_disconnect"), self.settings.stream_buffer_events)
            return
        result = await collect_or_cancel(session.collect(), req)
        choice = result.choices.get(0)
        if choice is None or choice.get("finish_reason") is None:
            raise WorkerError("the model ended without a result", code="malformed_worker_response",
                              extra={"attempt_id": session.attempt_id})
        if choice["finish_reason"] in ("cancelled", "error"):
            err = worker_error(choice["finish_reason"] if choice["finish_reason"] == "cancelled" else "inference_error",
                               "the model did not complete the request")
            err.extra["attempt_id"] = session.attempt_id
            raise err
        answer = render_generate_response(greq, result, profile.name, session.attempt_id)
        if req.client_prefers(["application/json", *MSGPACK_TYPES]) in MSGPACK_TYPES:  # asked for, not just accepted
            resp.content_type = "application/msgpack"
            resp.data = msgpack_body.encode(answer)
            return
        resp.content_type = "application/json"
        resp.data = orjson.dumps(answer)
