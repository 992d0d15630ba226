"""POST /tokenize and POST /detokenize (vLLM's shapes): the model's own tokenizer, reached through Triton."""

from __future__ import annotations

import orjson

from gateway.body import read_json_body
from gateway.contracts.tokenize import parse_detokenize_request, parse_tokenize_request
from gateway.domain import TokenizerResult, TokenizerTask
from gateway.errors import GatewayError
from gateway.resources.common import routing_hints
from gateway.service import GenerationService
from gateway.settings import Settings
from gateway.triton.client import UpstreamUnavailable


class _TokenizerResource:
    def __init__(self, settings: Settings, service: GenerationService) -> None:
        self.settings = settings
        self.service = service

    async def run(self, req, model: str, task: TokenizerTask) -> TokenizerResult:
        """The model's tokenizer on the first endpoint that answers (like a generation, before its first token)."""
        profile, machine_profile = await self.service.lookup(model)
        req.context.model = profile.name
        hints = routing_hints(req, None, machine_profile)
        last_error: GatewayError | None = None
        for endpoint in self.service.router.candidates(profile, hints):
            try:
                return await endpoint.client.tokenize(profile.triton_model, task, req.context.request_id)
            except UpstreamUnavailable as exc:
                self.service.registry.mark_unhealthy(endpoint)
                last_error = exc
        raise last_error or UpstreamUnavailable("no endpoint could run the tokenizer")


class TokenizeResource(_TokenizerResource):
    async def on_post(self, req, resp) -> None:
        body = await read_json_body(req, self.settings.chat_body_limit, self.settings.body_read_timeout_s)
        request = parse_tokenize_request(body)
        result = await self.run(req, request.model, request.task())
        resp.content_type = "application/json"
        resp.data = orjson.dumps({"count": len(result.token_ids), "max_model_len": result.max_model_len,
                                  "tokens": result.token_ids,
                                  "token_strs": result.token_strs if request.return_token_strs else None})


class DetokenizeResource(_TokenizerResource):
    async def on_post(self, req, resp) -> None:
        body = await read_json_body(req, self.settings.chat_body_limit, self.settings.body_read_timeout_s)
        request = parse_detokenize_request(body)
        result = await self.run(req, request.model, request.task())
        resp.content_type = "application/json"
        resp.data = orjson.dumps({"prompt": result.text})
