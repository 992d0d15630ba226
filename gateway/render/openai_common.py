"""Pieces both OpenAI renderers (chat, completions) share: the usage object and the fingerprint."""

from __future__ import annotations

import hashlib
from typing import Any

from gateway.settings import VERSION


def system_fingerprint(model: str) -> str:
    digest = hashlib.blake2b(f"{model}|{VERSION}".encode(), digest_size=8).hexdigest()
    return f"fp_{digest}"


def openai_usage(prompt: int, completion: int, cached: int = 0) -> dict[str, Any]:
    """OpenAI's usage object; `cached` prompt tokens came from the engine's prefix cache."""
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion,
            "prompt_tokens_details": {"cached_tokens": cached}}
