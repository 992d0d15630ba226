"""JSON Schemas of the request contracts, for `/openapi.json`."""

from __future__ import annotations

from typing import Any

from gateway.contracts.chat import ChatCompletionRequest
from gateway.contracts.generate import GenerateRequest


def openapi_schemas() -> dict[str, dict[str, Any]]:
    """Request-body schemas keyed by component name."""
    return {
        "ChatCompletionRequest": ChatCompletionRequest.model_json_schema(),
        "GenerateRequest": GenerateRequest.model_json_schema(),
    }
