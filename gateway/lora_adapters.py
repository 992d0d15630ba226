"""What the registry knows of run-time LoRA adapters (docs/lora.md): the engine's own list is the truth.

A load or unload answers with the adapters the model serves after it; each endpoint's profile takes that list at
once, and every discovery refresh asks the model again (`lora_control` action `list`), so a refresh never drops a
loaded adapter and a reloaded model (which forgot its run-time adapters) is not credited with them.
"""

from __future__ import annotations

import dataclasses
import logging
import uuid

from gateway.errors import GatewayError
from gateway.profile import ModelProfile

log = logging.getLogger(__name__)
CONTROL_INPUT = "lora_control"


def adopt(endpoint, triton_model: str, names: list[str]) -> None:
    """The endpoint's profile of `triton_model` now lists exactly `names` as its adapters."""
    for key, profile in list(endpoint.models.items()):
        if profile.triton_model == triton_model:
            endpoint.models[key] = dataclasses.replace(profile, lora_adapters=frozenset(names))


async def with_live_adapters(client, profile: ModelProfile) -> ModelProfile:
    """`profile` with the adapters its model serves now; unchanged when the model cannot say (kept as configured)."""
    try:
        names = await client.lora_control(profile.triton_model, {"action": "list"}, f"lora-list-{uuid.uuid4().hex}")
    except (GatewayError, OSError) as exc:
        log.debug("listing the LoRA adapters of %s failed: %s", profile.triton_model, type(exc).__name__)
        return profile
    return dataclasses.replace(profile, lora_adapters=frozenset(names))
