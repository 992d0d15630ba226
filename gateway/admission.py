"""Admission of a generation request by its key's settings (docs/auth.md, "Per-key limits and priorities"): the
priorities the key may ask for, its concurrency and tokens-per-minute limits, and the fair-share tenant the engine
schedules it as.

Concurrency is taken when the request arrives (before its body is read) and given back when its answer ends in any
way: a buffered answer when it is sent, a stream at its last chunk, an error, or the client leaving (Falcon closes
the body). Tokens are counted once the body is validated and the model resolved, from the request itself: the
gateway holds no tokenizer, so a prompt counts as its characters / 4 (OpenAI's own estimate for its rate limits),
token-id prompts as their length, plus the completion cap (`max_tokens`) of every candidate. Nothing is refunded
when a request uses less.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

from gateway.auth import Authenticator
from gateway.auth_tokens import Tenant
from gateway.domain import GenerationRequest, Prompt
from gateway.errors import InvalidRequest
from gateway.metrics import RATE_LIMITED
from gateway.middleware import BodyEnd, route_name, streams_body
from gateway.rate_limits import RateLimited, RateLimiter

MAX_TENANT_LABELS = 64  # distinct `tenant` label values per process; later tenants share "other"
CHARS_PER_TOKEN = 4


class Admission:
    """Falcon middleware (after the one that authenticates) and the admission step the generation resources call."""

    def __init__(self, auth: Authenticator, limiter: RateLimiter | None = None) -> None:
        self.auth = auth
        self.limiter = limiter or RateLimiter()
        self._labels: set[str] = set()

    async def process_request(self, req, resp) -> None:
        req.context.admission = self
        tenant: Tenant = req.context.tenant
        if req.method != "POST" or route_name(req.path) == "other" or tenant.policy.max_concurrent is None:
            return
        try:
            self.limiter.acquire(tenant.key_id, tenant.policy)
        except RateLimited as exc:
            self._count(tenant, exc)
            raise
        req.context.slot = tenant.key_id

    async def process_response(self, req, resp, resource, req_succeeded) -> None:
        for name, value in (req.context.get("rate_limit_headers") or {}).items():
            resp.set_header(name, value)
        key_id = req.context.get("slot")
        if key_id is None:
            return
        req.context.slot = None
        if streams_body(req, resp):  # the slot is held until the body ends, however it ends
            resp.stream = BodyEnd(resp.stream, lambda: self.limiter.release(key_id))
        else:
            self.limiter.release(key_id)

    def admit(self, req, greq: GenerationRequest, prompts: tuple[Prompt, ...] | None = None) -> GenerationRequest:
        """The request as the engine schedules it (its fair-share tenant and weight), once its priority is within
        the key's range (else 400 naming `priority`) and its tokens fit the key's tokens per minute (else 429)."""
        tenant: Tenant = req.context.tenant
        policy = tenant.policy
        if not policy.priority_min <= greq.priority <= policy.priority_max:
            raise InvalidRequest(f"'priority' must be in [{policy.priority_min}, {policy.priority_max}] for this "
                                 f"key (lower runs earlier), got {greq.priority}", param="priority")
        if policy.limited:
            try:
                req.context.rate_limit_headers = self.limiter.charge(
                    tenant.key_id, policy, estimated_tokens(greq, prompts))
            except RateLimited as exc:
                self._count(tenant, exc)
                raise
        fair_share = tenant.fair_share
        if fair_share is None and greq.user:  # auth off: one tenant per `user`, the rest share one
            fair_share = self.auth.user_tenant(greq.user)
        return dataclasses.replace(greq, tenant=fair_share, tenant_weight=policy.weight, user=None)

    def _count(self, tenant: Tenant, exc: RateLimited) -> None:
        label = (tenant.fair_share or tenant.key_id)[:12]
        if label not in self._labels:
            label = "other" if len(self._labels) >= MAX_TENANT_LABELS else label
            self._labels.add(label)
        RATE_LIMITED.labels(tenant=label, limit=exc.type).inc()


def admit(req, greq: GenerationRequest, prompts: tuple[Prompt, ...] | None = None) -> GenerationRequest:
    """`Admission.admit` for the resources, through the request context the middleware filled."""
    admission: Admission = req.context.admission
    return admission.admit(req, greq, prompts)


def estimated_tokens(greq: GenerationRequest, prompts: tuple[Prompt, ...] | None = None) -> int:
    """What a request counts against tokens per minute: its prompts' estimate plus every candidate's cap."""
    candidates = max(greq.n, greq.best_of or 1)
    if prompts is None:
        prompts = (greq.prompt_token_ids if greq.prompt_token_ids is not None else greq.prompt or "",)
    prompt_tokens = sum(len(p) if isinstance(p, tuple) else _text_tokens(len(p)) for p in prompts)
    if greq.messages is not None:
        prompt_tokens += _text_tokens(sum(_message_chars(m) for m in greq.messages))
    return prompt_tokens + greq.max_tokens * candidates * len(prompts)


def _text_tokens(chars: int) -> int:
    return math.ceil(chars / CHARS_PER_TOKEN)


def _message_chars(message: dict[str, Any]) -> int:
    content = message.get("content")
    if isinstance(content, str):
        return len(content)
    if isinstance(content, list):
        return sum(len(part.get("text") or "") for part in content if isinstance(part, dict))
    return 0
