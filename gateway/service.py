"""The generation flow both contracts share: resolve, check, route, open the stream, enforce timeouts."""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
from collections.abc import AsyncGenerator
from dataclasses import dataclass, field

from gateway.contracts.profile_checks import check_against_profile
from gateway.domain import GenerationEvent, GenerationRequest, GenerationResult
from gateway.errors import GatewayError, MalformedWorkerResponse, UpstreamTimeout
from gateway.metrics import UPSTREAM_ERRORS
from gateway.profile import ModelProfile
from gateway.registry import Endpoint, ModelRegistry
from gateway.router import Router, RoutingHints
from gateway.settings import Settings
from gateway.triton.client import UpstreamUnavailable

log = logging.getLogger(__name__)


@dataclass
class GenerationSession:
    """An opened generation: the first event has arrived; iterate `events()` for all of them."""

    profile: ModelProfile
    request: GenerationRequest
    request_id: str
    endpoint: Endpoint
    first: GenerationEvent
    stream: AsyncGenerator[GenerationEvent, None]
    settings: Settings
    started: float
    ttft_s: float
    deadline: float
    closed: bool = field(default=False)

    async def events(self) -> AsyncGenerator[GenerationEvent, None]:
        try:
            yield self.first
            while True:
                timeout = min(self.settings.inter_chunk_timeout_s, self.deadline - time.monotonic())
                if timeout <= 0:
                    raise UpstreamTimeout("the request exceeded the overall timeout", code="overall_timeout")
                try:
                    # asyncio.timeout costs a timer handle; wait_for would cost a task per token
                    async with asyncio.timeout(timeout):
                        event = await anext(self.stream)
                except StopAsyncIteration:
                    return
                except TimeoutError:
                    if time.monotonic() >= self.deadline:
                        raise UpstreamTimeout("the request exceeded the overall timeout",
                                              code="overall_timeout") from None
                    raise UpstreamTimeout("no output from the model in time", code="inter_chunk_timeout",
                                          status=502) from None
                yield event
        finally:
            await self.close()

    async def close(self) -> None:
        if not self.closed:
            self.closed = True
            self.endpoint.outstanding -= 1
            await self.stream.aclose()

    async def collect(self) -> GenerationResult:
        """Accumulate every choice (blocking responses)."""
        choices: dict[int, dict] = {}
        prompt_tokens = 0
        last_at = time.monotonic()
        engine_timing: tuple[float, float | None] | None = None
        async for event in self.events():
            if event.ttft_ms is not None and engine_timing is None:
                engine_timing = (event.ttft_ms, event.tpot_ms)
            last_at = time.monotonic()
            choice = choices.setdefault(
                event.index, {"text": [], "finish_reason": None, "logprobs": [], "tool_calls": None,
                              "completion_tokens": 0, "reasoning": []}
            )
            choice["text"].append(event.text)
            if event.logprobs:
                choice["logprobs"].extend(event.logprobs)
            if event.reasoning:
                choice["reasoning"].append(event.reasoning)
            if event.finish_reason is not None:
                choice["finish_reason"] = event.finish_reason
                choice["tool_calls"] = event.tool_calls
                choice["completion_tokens"] = event.completion_tokens
                choice["stop_reason"] = event.stop_reason
            prompt_tokens = max(prompt_tokens, event.prompt_tokens)
        if any(c["finish_reason"] is None for c in choices.values()) or len(choices) < self.request.n:
            raise MalformedWorkerResponse("the model ended without closing every choice")
        for choice in choices.values():
            choice["text"] = "".join(choice["text"])
            choice["reasoning"] = "".join(choice["reasoning"]) or None
        completion = sum(c["completion_tokens"] for c in choices.values())
        if engine_timing is not None:
            # blocking requests get one event per choice: the engine measured the real TTFT/TPOT
            return GenerationResult(choices, prompt_tokens, completion, *engine_timing)
        decode_s = max(last_at - self.started - self.ttft_s, 0.0)
        tpot = decode_s / (completion - 1) * 1000 if completion > 1 else None
        return GenerationResult(choices, prompt_tokens, completion, self.ttft_s * 1000, tpot)


class GenerationService:
    def __init__(self, settings: Settings, registry: ModelRegistry) -> None:
        self.settings = settings
        self.registry = registry
        self.router = Router(registry)

    async def resolve(self, req: GenerationRequest) -> tuple[GenerationRequest, ModelProfile, str | None]:
        """Resolve the model and apply its profile: the request as it will run, or a contract error."""
        profile, machine_profile = await self.registry.resolve(req.model)
        if req.max_tokens_defaulted and req.max_tokens > profile.max_output_tokens:
            # the client set no cap: the gateway default must not turn into a context_exceeded error
            req = dataclasses.replace(req, max_tokens=profile.max_output_tokens)
        check_against_profile(req, profile)
        return req, profile, machine_profile

    async def open(
        self, req: GenerationRequest, profile: ModelProfile, hints: RoutingHints, request_id: str
    ) -> GenerationSession:
        """Route and wait for the first event; failures here are ordinary HTTP errors."""
        started = time.monotonic()
        deadline = started + self.settings.overall_timeout_s
        last_error: GatewayError | None = None
        for endpoint in self.router.candidates(profile, hints):
            stream = endpoint.client.generate(profile.triton_model, req, request_id)
            endpoint.outstanding += 1
            try:
                timeout = min(self.settings.first_chunk_timeout_s, deadline - started)
                async with asyncio.timeout(timeout):
                    first = await anext(stream)
            except UpstreamUnavailable as exc:
                # nothing was generated yet: another endpoint can take the request
                endpoint.outstanding -= 1
                self.registry.mark_unhealthy(endpoint)
                UPSTREAM_ERRORS.labels(code=exc.code).inc()
                log.warning("endpoint %s failed before the first token; trying another", endpoint.name)
                last_error = exc
                continue
            except TimeoutError:
                endpoint.outstanding -= 1
                await stream.aclose()
                if self.settings.overall_timeout_s <= self.settings.first_chunk_timeout_s:
                    raise UpstreamTimeout("the request exceeded the overall timeout", code="overall_timeout") from None
                raise UpstreamTimeout("no output from the model in time", code="first_chunk_timeout") from None
            except StopAsyncIteration:
                endpoint.outstanding -= 1
                last_error = UpstreamUnavailable("the model ended the stream without output")
                continue
            except BaseException as exc:
                endpoint.outstanding -= 1
                await stream.aclose()
                if isinstance(exc, GatewayError):
                    UPSTREAM_ERRORS.labels(code=exc.code).inc()
                raise
            return GenerationSession(
                profile, req, request_id, endpoint, first, stream, self.settings,
                started, time.monotonic() - started, deadline,
            )
        assert last_error is not None
        raise last_error
