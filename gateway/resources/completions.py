"""POST /v1/completions (OpenAI legacy completions)."""

from __future__ import annotations

import time

import orjson

from gateway.admission import admit
from gateway.body import read_json_body
from gateway.contracts.completions import parse_completion_request
from gateway.fanout import open_prompts
from gateway.metrics import TTFT
from gateway.render.completions import CompletionShape, CompletionStreamRenderer, render_completion
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


class CompletionsResource:
    def __init__(self, settings: Settings, service: GenerationService) -> None:
        self.settings = settings
        self.service = service

    async def on_post(self, req, resp) -> None:
        body = await read_json_body(req, self.settings.chat_body_limit, self.settings.body_read_timeout_s)
        job = parse_completion_request(body)
        greq, profile, machine_profile = await self.service.resolve(job.request, forbid_remote=remote_forbidden(req))
        greq = admit(req, greq, job.prompts)
        req.context.model = profile.name
        hints = routing_hints(req, greq, machine_profile)
        request_id = req.context.request_id
        shape = CompletionShape(request_id, int(time.time()), profile.name, job.prompts, greq.n, job.echo,
                                job.logprobs)
        opening = open_prompts(self.service, greq, job.prompts, profile, hints, request_id)
        session = await collect_or_cancel(opening, req)
        record_answering_endpoint(req, session)
        TTFT.labels(endpoint="completions", model=profile.name).observe(session.ttft_s)
        if greq.stream:
            set_sse_headers(resp)
            renderer = CompletionStreamRenderer(shape, greq.include_usage, job.continuous_usage)
            resp.stream = sse_stream(session.events(), renderer, self.settings.keepalive_interval_s,
                                     req.scope.get("sie.watch_disconnect"))
            return
        result = await collect_or_cancel(session.collect(), req)
        resp.content_type = "application/json"
        resp.data = orjson.dumps(render_completion(shape, result))
