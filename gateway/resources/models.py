"""GET /v1/models and /v1/models/{id}: one entry per served model, readable by both kinds of client.

- The openai SDK (and vLLM-style tools) read `{"object": "list", "data": [...]}` and OpenAI's model object
  (`id`, `object`, `created`, `owned_by`).
- The real sie-sdk's `list_models()` reads the listing's `models`, and `get_model()` the object itself, as its
  `ModelInfo` (`name`, `loaded`, `state`, `inputs`, `outputs`, `max_sequence_length`, `revision`, `capabilities`,
  `routing`). As SIE's gateway does, one object carries both key sets.

`sie_id`, `max_output_tokens` and `lora_adapters` are this gateway's own. Only models a healthy endpoint serves are
listed, so each one is `loaded`.
"""

from __future__ import annotations

import time
import urllib.parse
from typing import Any

import falcon
import orjson

from gateway.profile import ModelProfile
from gateway.registry import ModelRegistry


class ModelsResource:
    def __init__(self, registry: ModelRegistry) -> None:
        self.registry = registry
        self.created = int(time.time())

    def _model(self, p: ModelProfile) -> dict[str, Any]:
        return {
            "id": p.name, "object": "model", "created": self.created, "owned_by": "sie",
            "name": p.name, "loaded": True, "state": "loaded", "last_error": None,
            "inputs": ["text", "image"] if p.image_input else ["text"], "outputs": ["text"],
            "max_sequence_length": p.context_length,
            "revision": p.revision,  # the X-SIE-Model-Revision of its answers
            "capabilities": {"streaming": p.streaming, "grammar": sorted(p.grammar_kinds), "tools": True,
                             "lora_adapters": sorted(p.lora_adapters)},
            "routing": {"policy": "remote_only" if self._only_remote(p) else None, "upstream_kind": None},
            "sie_id": p.sie_id, "max_output_tokens": p.max_output_tokens, "lora_adapters": sorted(p.lora_adapters),
        }

    def _only_remote(self, p: ModelProfile) -> bool:
        """Every healthy endpoint serving it is configured remote (`X-SIE-Remote: forbid` cannot reach it)."""
        serving = [e for e in self.registry.endpoints if e.healthy and p.name in e.models]
        return bool(serving) and all(e.config.remote for e in serving)

    async def on_get(self, req, resp) -> None:
        if not self.registry.refreshed_once:
            await self.registry.refresh()
        await self.registry.catch_up()
        profiles = self.registry.profiles()
        models = [self._model(p) for p in profiles]
        # each LoRA adapter is a model id of its own for OpenAI clients, with its base as `parent` (vLLM's listing)
        adapters = [{"id": name, "object": "model", "created": self.created, "owned_by": "sie", "root": name,
                     "parent": p.name} for p in profiles for name in sorted(p.lora_adapters)]
        resp.content_type = "application/json"
        resp.data = orjson.dumps({"object": "list", "data": models + adapters, "models": models})

    async def retrieve(self, req, resp, **params: str) -> None:
        """GET /v1/models/{id} (OpenAI `models.retrieve`, the sie-sdk's `get_model`); the id may contain slashes or
        be SIE-safe."""
        if req.method != "GET":
            raise falcon.HTTPMethodNotAllowed(["GET"])
        requested = urllib.parse.unquote(req.path[len("/v1/models/"):])
        profile, _ = await self.registry.resolve(requested)
        resp.content_type = "application/json"
        resp.data = orjson.dumps(self._model(profile))
