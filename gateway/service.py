"""The generation flow both contracts share: resolve, check, route, open the stream (gateway/session.py runs it)."""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
from collections.abc import Callable

from gateway.contracts.profile_checks import check_against_profile
from gateway.domain import GenerationRequest
from gateway.drain import DeadlineWait, Drain
from gateway.endpoint import Endpoint, InFlight
from gateway.errors import (
    GatewayError,
    InvalidRequest,
    ModelProcessDied,
    Provisioning,
    Unavailable,
    UpstreamTimeout,
    WorkerError,
    quoted,
)
from gateway.metrics import UPSTREAM_ERRORS
from gateway.prefix_routing import PrefixRouting
from gateway.profile import ModelProfile
from gateway.registry import ModelRegistry
from gateway.router import Router, RoutingHints
from gateway.session import GenerationSession, attempt_id, attribute, upstream_cancelled, we_are_cancelled
from gateway.settings import Settings
from gateway.timeouts import Timeouts
from gateway.triton.client import UpstreamUnavailable

log = logging.getLogger(__name__)
# (endpoint, Triton model, why): the model's process there is dead; take it out of service and reload it
ModelDied = Callable[[Endpoint, str, str], None]


class GenerationService:
    def __init__(self, settings: Settings, registry: ModelRegistry, model_died: ModelDied,
                 drain: Drain | None = None, prefix_routing: PrefixRouting | None = None) -> None:
        self.settings = settings
        self.registry = registry
        self.model_died = model_died  # the supervisor's, given by the app's wiring
        self.drain = drain or Drain()
        self.router = Router(registry)
        self.prefix_routing = prefix_routing  # None: no endpoint publishes its KV events to us

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
        for endpoint in await self._candidates(req, profile, hints, request_id):
            stream = endpoint.client.generate(profile.triton_model, _scoped(req, hints, endpoint, profile), request_id)
            # every way out of this block gives the endpoint's count back and closes the stream, except the session
            async with InFlight(endpoint, stream) as claim:
                try:
                    timeout = min(timeouts.first_chunk_s, deadline - started)
                    async with asyncio.timeout(timeout) as wait.timeout:
                        first = await anext(stream)
                except UpstreamUnavailable as exc:
                    # nothing was generated yet: another endpoint can take the request
                    self.registry.mark_unhealthy(endpoint)
                    UPSTREAM_ERRORS.labels(code=exc.code).inc()
                    log.warning("endpoint %s failed before the first token; trying another", endpoint.name)
                    # the same answer as the requests after it, which find the endpoint unhealthy (503 PROVISIONING):
                    # within one outage the code and Retry-After do not change from one request to the next
                    last_error = self.registry.provisioning(
                        f"no Triton endpoint serving '{profile.name}' is reachable ({exc.message}); provisioning in "
                        "progress, retry shortly")
                    continue
                except ModelProcessDied as exc:
                    # the model's process on this endpoint is dead: out of service, reloaded; another may serve it
                    self.model_died(endpoint, profile.triton_model,
                                    "a request was answered 'Stub process is not healthy'")
                    UPSTREAM_ERRORS.labels(code=exc.code).inc()
                    last_error = exc
                    continue
                except TimeoutError:
                    wait.check()  # the drain deadline, not a slow model
                    if timeouts.overall_s <= timeouts.first_chunk_s:
                        raise UpstreamTimeout("the request exceeded the overall timeout",
                                              code="overall_timeout") from None
                    raise UpstreamTimeout("no output from the model in time", code="first_chunk_timeout") from None
                except StopAsyncIteration:
                    last_error = UpstreamUnavailable("the model ended the stream without output")
                    continue
                except BaseException as exc:
                    if isinstance(exc, asyncio.CancelledError) and not we_are_cancelled():
                        exc = upstream_cancelled()
                    if isinstance(exc, GatewayError):
                        UPSTREAM_ERRORS.labels(code=exc.code).inc()
                    if isinstance(exc, WorkerError):
                        attribute(exc, req, attempt_id(request_id, endpoint))
                    raise exc from None
                return GenerationSession(
                    profile, req, request_id, claim.hand_over(), first, timeouts,
                    started, time.monotonic() - started, deadline, self.drain, wait,
                    self.settings.provisioning_retry_after_s,
                )
        assert last_error is not None
        raise last_error


    async def _candidates(self, req: GenerationRequest, profile: ModelProfile, hints: RoutingHints,
                          request_id: str) -> list[Endpoint]:
        """The router's order; where engines publish their KV events, the one holding the prompt's blocks first."""
        candidates = self.router.candidates(profile, hints)
        if self.prefix_routing is None or hints.affinity_key:
            return candidates
        salt = hints.cache_salt if profile.cache_salt_input else None
        return await self.prefix_routing.order(candidates, req, profile, salt, request_id)


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
    """The request with its tenant's prefix-cache salt and fair-share tenant, each where the endpoint's model declares
    the input (a model that does not would refuse the request; its cache and capacity are then shared, docs/auth.md)."""
    served = endpoint.models.get(profile.name, profile)
    if req.tenant is not None and not served.tenant_input:
        req = dataclasses.replace(req, tenant=None)
    if hints.cache_salt is None or not served.cache_salt_input:
        return req
    return dataclasses.replace(req, cache_salt=hints.cache_salt)
