"""Health, readiness, model list, metrics, OpenAPI."""

from __future__ import annotations

import json
import time
import urllib.parse

import falcon
import orjson

from gateway.drain import Drain
from gateway.errors import format_retry_after
from gateway.metrics import render_metrics
from gateway.profile import ModelProfile
from gateway.registry import ModelRegistry


class HealthResource:
    async def on_get(self, req, resp) -> None:
        resp.data = orjson.dumps({"status": "ok"})
        resp.content_type = "application/json"


READY_MAX_AGE_S = 1.0


class VllmHealthResource:
    """GET /health in vLLM's shape (GuideLLM's backend check): 200 with an empty body while a model can be
    served, else 503; it reads the registry's last refresh, never Triton per call."""

    def __init__(self, registry: ModelRegistry) -> None:
        self.registry = registry

    async def on_get(self, req, resp) -> None:
        await self.registry.refresh_if_stale(max_age_s=READY_MAX_AGE_S)
        if not any(e.healthy and e.models for e in self.registry.endpoints):
            resp.status = 503
            resp.set_header("Retry-After", format_retry_after(self.registry.settings.provisioning_retry_after_s))
        resp.data = b""


class VersionResource:
    """GET /version in vLLM's shape: `{"version": ...}` (the SIE contract version this gateway serves)."""

    def __init__(self, version: str) -> None:
        self.body = orjson.dumps({"version": version})

    async def on_get(self, req, resp) -> None:
        resp.content_type = "application/json"
        resp.data = self.body


class ReadyResource:
    def __init__(self, registry: ModelRegistry, drain: Drain) -> None:
        self.registry = registry
        self.drain = drain

    async def on_get(self, req, resp) -> None:
        if self.drain.draining:  # SIGTERM: out of the load balancer at once, whatever Triton says
            resp.status, resp.content_type = 503, "application/json"
            resp.data = orjson.dumps({"status": "draining", "healthy_workers": 0})
            return
        # readiness reflects Triton as of at most a second ago: fresh enough for a probe, and open to anyone
        # without a Triton call per request (concurrent probes share one refresh)
        await self.registry.refresh_if_stale(max_age_s=READY_MAX_AGE_S)
        healthy = sum(1 for e in self.registry.endpoints if e.healthy and e.models)
        resp.content_type = "application/json"
        if healthy:
            resp.data = orjson.dumps({"status": "ready", "healthy_workers": healthy})
        else:
            resp.status = 503
            # the Retry-After of every other answer in the same outage (503 PROVISIONING)
            resp.set_header("Retry-After", format_retry_after(self.registry.settings.provisioning_retry_after_s))
            resp.data = orjson.dumps({"status": "not_ready", "healthy_workers": 0})


class ModelsResource:
    def __init__(self, registry: ModelRegistry) -> None:
        self.registry = registry
        self.created = int(time.time())

    def _model(self, p: ModelProfile) -> dict:
        return {"id": p.name, "object": "model", "created": self.created, "owned_by": "sie", "sie_id": p.sie_id,
                "max_output_tokens": p.max_output_tokens, "lora_adapters": sorted(p.lora_adapters),
                "inputs": {"image": p.image_input}}

    async def on_get(self, req, resp) -> None:
        if not self.registry.refreshed_once:
            await self.registry.refresh()
        resp.content_type = "application/json"
        resp.data = orjson.dumps({"object": "list", "data": [self._model(p) for p in self.registry.profiles()]})

    async def retrieve(self, req, resp, **params: str) -> None:
        """GET /v1/models/{id} (OpenAI `models.retrieve`); the id may contain slashes or be SIE-safe."""
        if req.method != "GET":
            raise falcon.HTTPMethodNotAllowed(["GET"])
        requested = urllib.parse.unquote(req.path[len("/v1/models/"):])
        profile, _ = await self.registry.resolve(requested)
        resp.content_type = "application/json"
        resp.data = orjson.dumps(self._model(profile))


class MetricsResource:
    async def on_get(self, req, resp) -> None:
        resp.data, resp.content_type = render_metrics()


class OpenAPIResource:
    def __init__(self, document: dict) -> None:
        self.body = json.dumps(document).encode()  # built once; may hold integers beyond orjson's 64-bit range

    async def on_get(self, req, resp) -> None:
        resp.content_type = "application/json"
        resp.data = self.body
