"""POST /v1/chat/completions."""

from __future__ import annotations

import time

import orjson

from gateway.admission import admit
from gateway.body import read_json_body
from gateway.contracts.chat import parse_chat_request
from gateway.metrics import TTFT
from gateway.render.chat import ChatStreamRenderer, render_chat_completion
from gateway.resources.common import (
    collect_or_cancel,
    record_answering_endpoint,
    remote_forbidden,
    routing_hints,
    set_sse_headers,
)
from gateway.service import GenerationService
from gateway.settings import Settings
from gateway.streaming import sse_stream


class ChatCompletionsResource:
    def __init__(self, settings: Settings, service: GenerationService) -> None:
        self.settings = settings
        self.service = service

    async def on_post(self, req, resp) -> None:
        body = await read_json_body(req, self.settings.chat_body_limit, self.settings.body_read_timeout_s)
        greq = parse_chat_request(body, default_max_tokens=self.settings.default_max_tokens)
        greq, profile, machine_profile = await self.service.resolve(greq, forbid_remote=remote_forbidden(req))
        greq = admit(req, greq)
        req.context.model = profile.name
        hints = routing_hints(req, greq, machine_profile)
        request_id = req.context.request_id
        created = int(time.time())
        session = await collect_or_cancel(self.service.open(greq, profile, hints, request_id), req)
        record_answering_endpoint(req, session)
        TTFT.labels(endpoint="chat", model=profile.name).observe(session.ttft_s)
        if greq.stream:
            set_sse_headers(resp)
            renderer = ChatStreamRenderer(greq, request_id, created, profile.name, profile.reasoning)
            resp.stream = sse_stream(session.events(), renderer, self.settings.keepalive_interval_s,
                                     req.scope.get("sie.watch_disconnect"), self.settings.stream_buffer_events)
            return
        result = await collect_or_cancel(session.collect(), req)
        resp.content_type = "application/json"
        resp.data = orjson.dumps(
            render_chat_completion(greq, result, request_id, created, profile.name, profile.reasoning)
        )
