"""POST /v1/responses (OpenAI Responses API); GET / DELETE /v1/responses/{response_id} on the store."""

from __future__ import annotations

import logging
import time
from collections.abc import AsyncIterator
from typing import Any

import orjson

from gateway.admission import admit
from gateway.body import read_json_body
from gateway.contracts.responses import ResponsesJob, check_reasoning_effort, parse_responses_request
from gateway.errors import InvalidRequest, NotFound
from gateway.metrics import TTFT
from gateway.render.responses import ResponseShape, output_messages, render_response
from gateway.render.responses_stream import ResponsesStreamRenderer
from gateway.resources.common import (
    collect_or_cancel,
    record_answering_endpoint,
    remote_forbidden,
    routing_hints,
    set_sse_headers,
)
from gateway.responses_store import ResponseStore
from gateway.service import GenerationService
from gateway.settings import Settings
from gateway.streaming import sse_stream

log = logging.getLogger(__name__)

_NO_STORE = "needs a response store, and this gateway runs without one (SIE_RESPONSES_STORE=off)"


class ResponsesResource:
    def __init__(self, settings: Settings, service: GenerationService, store: ResponseStore | None) -> None:
        self.settings = settings
        self.service = service
        self.store = store

    async def on_post(self, req, resp) -> None:
        body = await read_json_body(req, self.settings.chat_body_limit, self.settings.body_read_timeout_s)
        job = parse_responses_request(body, default_max_tokens=self.settings.default_max_tokens)
        request = job.request
        if request.store and self.store is None:
            raise InvalidRequest(f"'store: true' {_NO_STORE}; send 'store: false'", param="store")
        # OpenAI's default is to store: with a store configured, only an explicit `store: false` opts out
        store = self.store if request.store is not False else None
        owner = req.context.tenant.owner  # a stored response belongs to the tenant of the key that made it
        history = await self._history(job, owner)
        greq, profile, machine_profile = await self.service.resolve(job.generation_request(history),
                                                                  forbid_remote=remote_forbidden(req))
        check_reasoning_effort(request, profile)
        greq = admit(req, greq)
        req.context.model = profile.name
        hints = routing_hints(req, greq, machine_profile)
        request_id = req.context.request_id
        shape = ResponseShape(request, request_id, int(time.time()), profile.name, request.previous_response_id,
                              stored=store is not None,
                              sampling_defaults=(profile.default_temperature, profile.default_top_p))
        session = await collect_or_cancel(self.service.open(greq, profile, hints, request_id), req)
        record_answering_endpoint(req, session)
        TTFT.labels(endpoint="responses", model=profile.name).observe(session.ttft_s)
        conversation = [*history, *request.parsed_input.messages]
        if greq.stream:
            set_sse_headers(resp)
            tools_active = bool(greq.tools) and greq.tool_choice != "none"
            renderer = ResponsesStreamRenderer(shape, tools_active, greq.logprobs)
            frames = sse_stream(session.events(), renderer, self.settings.keepalive_interval_s,
                                req.scope.get("sie.watch_disconnect"), self.settings.stream_buffer_events,
                                named_events=True)
            resp.stream = _store_before_terminal(frames, renderer, store, conversation, owner)
            return
        result = await collect_or_cancel(session.collect(), req)
        response = render_response(shape, result)
        if store is not None:
            await store.put(shape.id, response, conversation + output_messages(response), owner=owner)
        resp.content_type = "application/json"
        resp.data = orjson.dumps(response)

    async def _history(self, job: ResponsesJob, owner: str) -> tuple[dict[str, Any], ...]:
        """The conversation `previous_response_id` continues: its input and its answer, tool items included.
        Another tenant's response is not found, in the same words as one that never existed."""
        previous = job.request.previous_response_id
        if previous is None:
            return ()
        if self.store is None:
            raise InvalidRequest(f"'previous_response_id' {_NO_STORE}; send the whole conversation as 'input'",
                                 param="previous_response_id")
        stored = await self.store.get(previous, owner=owner)
        if stored is None:
            raise InvalidRequest(f"previous response '{previous}' was not found (never stored, deleted or expired)",
                                 param="previous_response_id")
        return tuple(stored.conversation)


async def _store_before_terminal(frames: AsyncIterator[bytes], renderer: ResponsesStreamRenderer,
                                 store: ResponseStore | None, conversation: list[dict[str, Any]], owner: str
                                 ) -> AsyncIterator[bytes]:
    """Store the final object before the client reads the terminal event, so a follow-up request that
    names this response (right after `response.completed`) always finds it."""
    pending = store is not None
    async for chunk in frames:
        if pending and store is not None and renderer.final_response is not None:
            pending = False
            response = renderer.final_response
            try:
                await store.put(response["id"], response, conversation + output_messages(response), owner=owner)
            except Exception:  # the answer is already streaming: say so in the log, finish the stream
                log.exception("could not store response %s", response["id"])
        yield chunk


class StoredResponseResource:
    """GET (retrieve) and DELETE on `/v1/responses/{response_id}`, for the tenant that owns it: to any other, the
    same 404 as an id never stored."""

    def __init__(self, store: ResponseStore | None) -> None:
        self.store = store

    def _store(self) -> ResponseStore:
        if self.store is None:
            raise InvalidRequest(f"retrieving a response {_NO_STORE}", param="response_id")
        return self.store

    async def on_get(self, req, resp, response_id: str) -> None:
        stored = await self._store().get(response_id, owner=req.context.tenant.owner)
        if stored is None:
            raise NotFound(f"response '{response_id}' was not found", param="response_id")
        resp.content_type = "application/json"
        resp.data = orjson.dumps(stored.response)

    async def on_delete(self, req, resp, response_id: str) -> None:
        if not await self._store().delete(response_id, owner=req.context.tenant.owner):
            raise NotFound(f"response '{response_id}' was not found", param="response_id")
        resp.content_type = "application/json"
        resp.data = orjson.dumps({"id": response_id, "object": "response", "deleted": True})
