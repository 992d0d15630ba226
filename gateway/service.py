"""The generation flow both contracts share: resolve, check, route, open the stream, enforce timeouts."""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import re
import time
from collections.abc import AsyncGenerator
from dataclasses import dataclass, field

from gateway.contracts.profile_checks import check_against_profile
from gateway.domain import GenerationEvent, GenerationRequest, GenerationResult
from gateway.drain import DeadlineWait, Drain, ShuttingDown
from gateway.errors import (
    GatewayError,
    InvalidRequest,
    MalformedWorkerResponse,
    ModelProcessDied,
    Provisioning,
    Unavailable,
    UpstreamTimeout,
    WorkerError,
    quoted,
    worker_error,
)
from gateway.metrics import UPSTREAM_ERRORS
from gateway.profile import ModelProfile
from gateway.registry import Endpoint, ModelRegistry
from gateway.router import Router, RoutingHints
from gateway.settings import Settings
from gateway.timeouts import Timeouts
from gateway.triton.client import UpstreamUnavailable

log = logging.getLogger(__name__)
_IMAGE_PARAM = re.compile(r"images\[(\d+)\]")  # how the engine names one of a request's images


@dataclass
class GenerationSession:
    """An opened generation: the first event has arrived; iterate `events()` for all of them."""

    profile: ModelProfile
    request: GenerationRequest
    request_id: str
    endpoint: Endpoint
    first: GenerationEvent
    stream: AsyncGenerator[GenerationEvent, None]
    timeouts: Timeouts
    started: float
    ttft_s: float
    deadline: float
    drain: Drain
    wait: DeadlineWait  # the drain deadline ends it with server_shutting_down (gateway/drain.py)
    outage_retry_after_s: float = 60.0  # one Retry-After for every answer of one Triton outage
    closed: bool = field(default=False)

    async def events(self) -> AsyncGenerator[GenerationEvent, None]:
        # A blocking request hears from the engine only at its first token (a progress marker) and when a
        # choice closes: the inter-chunk timeout would cut a long generation, or the wait between the
        # closures of n>1 choices, so only the overall deadline governs it after the first token.
        inter_chunk = self.timeouts.inter_chunk_s if self.request.stream else float("inf")
        try:
            yield self.first
            while True:
                self.wait.check()
                remaining = self.deadline - time.monotonic()
                if remaining <= 0:
                    raise UpstreamTimeout("the request exceeded the overall timeout", code="overall_timeout")
                try:
                    # asyncio.timeout costs a timer handle; wait_for would cost a task per token
                    async with asyncio.timeout(min(inter_chunk, remaining)) as self.wait.timeout:
                        event = await anext(self.stream)
                except StopAsyncIteration:
                    return
                except TimeoutError:
                    if self.wait.cut_short:
                        raise ShuttingDown() from None
                    # which bound was the binding one, not the clock after the fact: a loop timer may fire a
                    # little before the deadline, and that is still the overall timeout
                    if remaining <= inter_chunk:
                        raise UpstreamTimeout("the request exceeded the overall timeout",
                                              code="overall_timeout") from None
                    raise UpstreamTimeout("no output from the model in time", code="inter_chunk_timeout",
                                          status=502) from None
                except asyncio.CancelledError:
                    if _we_are_cancelled():
                        raise
                    raise upstream_cancelled() from None
                except UpstreamUnavailable as exc:  # Triton went away mid-request: the outage's Retry-After
                    exc.retry_after = self.outage_retry_after_s
                    raise
                except WorkerError as exc:
                    attribute(exc, self.request, self.attempt_id)
                    raise
                yield event
        finally:
            await self.close()

    @property
    def attempt_id(self) -> str:
        return attempt_id(self.request_id, self.endpoint)

    async def close(self) -> None:
        self.drain.untrack(self.wait)
        if not self.closed:
            self.closed = True
            self.endpoint.outstanding -= 1
            await self.stream.aclose()

    async def collect(self) -> GenerationResult:
        """Accumulate every choice (blocking responses)."""
        choices: dict[int, dict] = {}
        prompt_tokens = cached_tokens = 0
        last_at = time.monotonic()
        engine_timing: tuple[float, float | None] | None = None
        async for event in self.events():
            if event.is_progress:
                continue  # the engine's first-token marker on blocking requests (docs/triton-contract.md)
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
            cached_tokens = max(cached_tokens, event.cached_tokens)
        if any(c["finish_reason"] is None for c in choices.values()) or len(choices) < self.request.n:
            raise MalformedWorkerResponse("the model ended without closing every choice")
        for choice in choices.values():
            choice["text"] = "".join(choice["text"])
            choice["reasoning"] = "".join(choice["reasoning"]) or None
        completion = sum(c["completion_tokens"] for c in choices.values())
        if engine_timing is not None:
            # blocking requests get one event per choice: the engine measured the real TTFT/TPOT
            return GenerationResult(choices, prompt_tokens, completion, *engine_timing, cached_tokens=cached_tokens)
        decode_s = max(last_at - self.started - self.ttft_s, 0.0)
        tpot = decode_s / (completion - 1) * 1000 if completion > 1 else None
        return GenerationResult(choices, prompt_tokens, completion, self.ttft_s * 1000, tpot, cached_tokens)


class GenerationService:
    def __init__(self, settings: Settings, registry: ModelRegistry, drain: Drain | None = None) -> None:
        self.settings = settings
        self.registry = registry
        self.drain = drain or Drain()
        self.router = Router(registry)

    async def resolve(self, req: GenerationRequest, *, forbid_remote: bool = False
                      ) -> tuple[GenerationRequest, ModelProfile, str | None]:
        """Resolve the model and apply its profile: the request as it will run, or a contract error."""
        profile, machine_profile = await self.lookup(req.model, forbid_remote=forbid_remote)
        return self.apply_profile(req, profile), profile, machine_profile

    async def lookup(self, model: str, *, forbid_remote: bool = False) -> tuple[ModelProfile, str | None]:
        """The model id as the client wrote it -> (profile, machine profile of a `model:profile` suffix).

        404 for an unknown model, 503 while none is reachable, 400 naming `profile` for a suffix that no configured pool
        serves (docs/contract.md, "Request headers"). With `X-SIE-Remote: forbid`, nothing reachable is "no healthy
        local endpoint" (docs/contract.md, "Decisions" 15): 503 with Retry-After 5, not PROVISIONING's."""
        try:
            profile, machine_profile = await self.registry.resolve(model)
        except Provisioning:
            if forbid_remote:
                raise Unavailable("no healthy local endpoint serves this model", retry_after=5) from None
            raise
        if machine_profile not in (None, "default") and \
                machine_profile not in {p.machine_profile for p in self.settings.pools}:
            raise InvalidRequest(f"profile {quoted(machine_profile)} is not configured on this gateway",
                                 param="profile")
        return profile, machine_profile

    @staticmethod
    def apply_profile(req: GenerationRequest, profile: ModelProfile) -> GenerationRequest:
        if req.lora_adapter is None and req.model in profile.lora_adapters:  # model=<adapter>, as vLLM serves it
            req = dataclasses.replace(req, lora_adapter=req.model)
        if req.max_tokens_defaulted and req.max_tokens > profile.max_output_tokens:
            # the client set no cap: the gateway default must not turn into a context_exceeded error
            req = dataclasses.replace(req, max_tokens=profile.max_output_tokens)
        check_against_profile(req, profile)
        return req

    async def open(
        self, req: GenerationRequest, profile: ModelProfile, hints: RoutingHints, request_id: str
    ) -> GenerationSession:
        """Route and wait for the first event; failures here are ordinary HTTP errors."""
        wait = self.drain.track()  # from here, the drain deadline can end this generation
        try:
            wait.check()
            return await self._route(_on_the_wire(req), profile, hints, request_id, wait)
        except BaseException:
            self.drain.untrack(wait)
            raise

    async def _route(self, req: GenerationRequest, profile: ModelProfile, hints: RoutingHints, request_id: str,
                     wait: DeadlineWait) -> GenerationSession:
        """Try the router's candidates in order until one yields a first event."""
        started = time.monotonic()
        timeouts = Timeouts.for_request(self.settings, req.options)
        deadline = started + timeouts.overall_s
        last_error: GatewayError | None = None
        for endpoint in self.router.candidates(profile, hints):
            stream = endpoint.client.generate(profile.triton_model, _scoped(req, hints, endpoint, profile), request_id)
            endpoint.outstanding += 1
            try:
                timeout = min(timeouts.first_chunk_s, deadline - started)
                async with asyncio.timeout(timeout) as wait.timeout:
                    first = await anext(stream)
            except UpstreamUnavailable as exc:
                # nothing was generated yet: another endpoint can take the request
                endpoint.outstanding -= 1
                self.registry.mark_unhealthy(endpoint)
                UPSTREAM_ERRORS.labels(code=exc.code).inc()
                log.warning("endpoint %s failed before the first token; trying another", endpoint.name)
                # the same answer as the requests after it, which find the endpoint unhealthy (503 PROVISIONING):
                # within one outage the code and Retry-After do not change from one request to the next
                last_error = self.registry.provisioning(f"no Triton endpoint serving '{profile.name}' is reachable "
                                                        f"({exc.message}); provisioning in progress, retry shortly")
                continue
            except ModelProcessDied as exc:
                # the model's process on this endpoint is dead: out of service, reloaded; another may serve it
                endpoint.outstanding -= 1
                self.registry.supervisor.model_died(endpoint, profile.triton_model,
                                                    "a request was answered 'Stub process is not healthy'")
                UPSTREAM_ERRORS.labels(code=exc.code).inc()
                last_error = exc
                continue
            except TimeoutError:
                endpoint.outstanding -= 1
                await stream.aclose()
                wait.check()  # the drain deadline, not a slow model
                if timeouts.overall_s <= timeouts.first_chunk_s:
                    raise UpstreamTimeout("the request exceeded the overall timeout", code="overall_timeout") from None
                raise UpstreamTimeout("no output from the model in time", code="first_chunk_timeout") from None
            except StopAsyncIteration:
                endpoint.outstanding -= 1
                last_error = UpstreamUnavailable("the model ended the stream without output")
                continue
            except BaseException as exc:
                endpoint.outstanding -= 1
                await stream.aclose()
                if isinstance(exc, asyncio.CancelledError) and not _we_are_cancelled():
                    exc = upstream_cancelled()
                if isinstance(exc, GatewayError):
                    UPSTREAM_ERRORS.labels(code=exc.code).inc()
                if isinstance(exc, WorkerError):
                    attribute(exc, req, attempt_id(request_id, endpoint))
                raise exc from None
            return GenerationSession(
                profile, req, request_id, endpoint, first, stream, timeouts,
                started, time.monotonic() - started, deadline, self.drain, wait,
                self.settings.provisioning_retry_after_s,
            )
        assert last_error is not None
        raise last_error


def _on_the_wire(req: GenerationRequest) -> GenerationRequest:
    """The request as Triton gets it. A blocking request hears from the engine only at its first token and when a
    choice closes, so an inter-chunk bound would have nothing to time; one that asks for that bound
    (`options.inter_chunk_timeout_s`) is generated as a stream of deltas and collected here, so the bound holds
    between its chunks (502 `inter_chunk_timeout`, docs/contract.md, "Errors"). Without it, blocking stays lean."""
    if req.stream or (req.options or {}).get("inter_chunk_timeout_s") is None:
        return req
    return dataclasses.replace(req, stream=True)


def _scoped(req: GenerationRequest, hints: RoutingHints, endpoint: Endpoint, profile: ModelProfile
            ) -> GenerationRequest:
    """The request with its tenant's prefix-cache salt, where the endpoint's model declares the `cache_salt` input
    (a model that does not would refuse the request; its cache is then shared, docs/auth.md)."""
    if hints.cache_salt is None or not endpoint.models.get(profile.name, profile).cache_salt_input:
        return req
    return dataclasses.replace(req, cache_salt=hints.cache_salt)


def attempt_id(request_id: str, endpoint: Endpoint) -> str:
    """One try of a request on one endpoint: native blocking bodies and worker errors carry it."""
    return f"{request_id}.{endpoint.name}"


def attribute(exc: WorkerError, req: GenerationRequest, attempt: str) -> None:
    """A worker error names its attempt (docs/contract.md, "Errors"), and an error about the grammar, an image or the
    conversation names the client's field it came from (`response_format` / `text.format`, `images[i].data`,
    `input`: the engine only knows them as `grammar`, `images[i]`, `messages`)."""
    exc.extra.setdefault("attempt_id", attempt)
    if exc.param == "grammar" and req.grammar is not None:
        exc.param = req.grammar.param
    elif (image := _IMAGE_PARAM.fullmatch(exc.param or "")) and int(image[1]) < len(req.image_data_params):
        exc.param = req.image_data_params[int(image[1])]
    elif exc.param == "messages":
        exc.param = req.messages_param


def _we_are_cancelled() -> bool:
    """Whether a CancelledError is ours (the client left, the task is being cancelled) rather than
    the upstream call ending with gRPC CANCELLED, which must end the request with an error."""
    task = asyncio.current_task()
    return task is None or task.cancelling() > 0


def upstream_cancelled() -> GatewayError:
    return worker_error("cancelled", "the model server cancelled the request")
