"""What crosses the engine's boundary: the request a caller submits and the outputs it gets back."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from engine.errors import EngineError
from engine.sampling_params import SamplingParams

if TYPE_CHECKING:
    import torch


@dataclass
class RequestOutput:
    """One event for the caller: a delta of one choice, its closure, or the request's end."""

    request_id: str
    index: int
    text: str
    finish_reason: str | None = None
    logprobs: list[dict[str, Any]] | None = None
    prompt_tokens: int = 0
    completion_tokens: int = 0
    final: bool = False  # no more outputs follow for this request
    error: EngineError | None = None
    stop_reason: str | int | None = None  # the stop string matched, or the stop token id
    tool_calls: list[dict[str, Any]] | None = None
    reasoning: str | None = None
    ttft_ms: float | None = None  # on closing outputs: engine-side time to first token
    tpot_ms: float | None = None  # on closing outputs: mean time per output token after the first
    cached_tokens: int = 0  # of prompt_tokens, served from the prefix cache
    progress: bool = False  # an empty output that only says the first token exists (blocking requests)


@dataclass
class EngineRequest:
    request_id: str
    prompt_ids: list[int]
    params: SamplingParams
    on_output: Callable[[RequestOutput], None]
    stream: bool = True
    is_cancelled: Callable[[], bool] | None = None
    prompt_embeds: torch.Tensor | None = None  # [prompt_len, hidden] input embeddings when images are present
    arrival: float = field(default_factory=time.monotonic)
    grammar: Callable[[], Any] | None = None  # makes the per-sequence grammar state
    prompt_param: str = "messages"  # the request field a prompt-size error names ("prompt" on native generate)
    # the tenant's scope in the prefix cache (the `cache_salt` Triton input): its blocks are found only by requests
    # with the same salt. Kept out of the repr, so it never reaches a log line.
    cache_salt: str | None = field(default=None, repr=False)
    # for the scheduling policies (engine/triton/intake.py reads them off the Triton request): `priority` in vLLM's
    # meaning, lower runs earlier (-1000..1000, from `sampling_parameters`); `tenant`, who fair sharing counts the
    # request against (a keyed hash from the gateway, never a key or a name; None: the one shared tenant), and the
    # tenant's `tenant_weight`, its share relative to weight-1 tenants (both from the `tenant` input)
    priority: int = 0
    tenant: str | None = field(default=None, repr=False)
    tenant_weight: float = 1.0
