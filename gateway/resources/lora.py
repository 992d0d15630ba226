"""POST /v1/load_lora_adapter and /v1/unload_lora_adapter (vLLM's shapes, docs/lora.md).

Off unless `SIE_ALLOW_RUNTIME_LORA_UPDATING` is set (a 404 that says so, as vLLM has no such routes then). Both
routes stay behind the gateway's auth whatever SIE_AUTH_EXEMPT_OPERATIONAL says: they change what every client is
served. The change goes to every healthy endpoint serving the base model, as a `lora_control` request
(docs/triton-contract.md); each endpoint's answer (the adapters it serves after) is what the registry lists at once.
"""

from __future__ import annotations

import asyncio

from gateway.body import read_json_body
from gateway.contracts.lora import parse_load_lora_request, parse_unload_lora_request
from gateway.errors import GatewayError, InvalidRequest, NotFound
from gateway.lora_adapters import adopt
from gateway.profile import ModelProfile
from gateway.registry import ModelRegistry
from gateway.settings import Settings

OFF = ("run-time LoRA updating is off on this gateway; SIE_ALLOW_RUNTIME_LORA_UPDATING=1 turns "
       "/v1/load_lora_adapter and /v1/unload_lora_adapter on")


class LoraAdapterResource:
    def __init__(self, settings: Settings, registry: ModelRegistry, action: str) -> None:
        assert action in ("load", "unload")
        self.settings, self.registry, self.action = settings, registry, action

    async def on_post(self, req, resp) -> None:
        if not self.settings.allow_runtime_lora:
            raise NotFound(OFF)
        body = await read_json_body(req, self.settings.chat_body_limit, self.settings.body_read_timeout_s)
        if self.action == "load":
            load = parse_load_lora_request(body)
            name, model = load.lora_name, load.model
            control = {"action": "load", "lora_name": name, "lora_path": load.lora_path}
        else:
            unload = parse_unload_lora_request(body)
            name, model = unload.lora_name, unload.model
            control = {"action": "unload", "lora_name": name}
        profile = await self._base_model(model)
        req.context.model = profile.name
        endpoints = [e for e in self.registry.endpoints if e.healthy and profile.name in e.models]
        if not endpoints:
            raise self.registry.provisioning(f"no healthy endpoint serves '{profile.name}'; retry shortly")
        results = await asyncio.gather(
            *(e.client.lora_control(profile.triton_model, control, f"{req.context.request_id}-{i}")
              for i, e in enumerate(endpoints)), return_exceptions=True)
        failure: GatewayError | None = None
        for endpoint, result in zip(endpoints, results, strict=True):
            if isinstance(result, GatewayError):
                failure = failure or result
            elif isinstance(result, BaseException):
                raise result
            else:
                adopt(endpoint, profile.triton_model, result)
        self.registry.adapter_changes.announce()  # the sibling workers refresh before their next request
        if failure is not None:  # the endpoints that did change are listed as they are now
            raise failure
        resp.content_type = "text/plain; charset=utf-8"
        resp.text = f"Success: LoRA adapter '{name}' {'added' if self.action == 'load' else 'removed'} successfully."

    async def _base_model(self, model: str | None) -> ModelProfile:
        """The body's base model, or the only one served (several: `model` is required)."""
        if model is not None:
            profile, _ = await self.registry.resolve(model)
            return profile
        if not self.registry.refreshed_once:
            await self.registry.refresh()
        await self.registry.catch_up()
        served = self.registry.profiles()
        if len(served) == 1:
            return served[0]
        if not served:
            raise self.registry.provisioning("no model is served yet; retry shortly")
        raise InvalidRequest(f"'model' is required: this gateway serves {len(served)} models "
                             f"({', '.join(p.name for p in served)})", param="model")
