"""Pick the Triton endpoint for a request: pool / machine profile / remote rules, affinity, load."""

from __future__ import annotations

import hashlib
import random
import re
from dataclasses import dataclass, field

from gateway.endpoint import Endpoint
from gateway.errors import (
    InvalidRequest,
    MachineProfileNotConfigured,
    NotFound,
    PoolCapacityUnavailable,
    Unavailable,
    quoted,
)
from gateway.profile import ModelProfile
from gateway.registry import ModelRegistry

_POOL_NAME = re.compile(r"^[A-Za-z0-9_-]{1,128}$")


@dataclass(frozen=True)
class RoutingHints:
    pool: str | None = None
    machine_profile: str | None = None
    forbid_remote: bool = False
    affinity_key: str | None = None  # routing_key or prompt_cache_key
    # the tenant's prefix-cache salt (gateway/auth_tokens.py), sent to endpoints whose model takes it; None: the
    # shared cache. Out of the repr: it has no business in a log line.
    cache_salt: str | None = field(default=None, repr=False)


def parse_pool(value: str | None) -> str | None:
    if value is None:
        return None
    if not _POOL_NAME.match(value) or value.lower() == "_default":
        raise InvalidRequest("X-SIE-Pool must match [A-Za-z0-9_-]{1,128} and not be '_default'", param="pool")
    return value.lower()


def parse_machine_profile(value: str | None) -> tuple[str | None, str | None]:
    """`X-SIE-MACHINE-PROFILE` may be `profile` or `pool/profile`; returns (pool, profile)."""
    if not value:
        return None, None
    if "/" in value:
        pool, _, profile = value.partition("/")
        return parse_pool(pool), profile or None
    return None, value


# `X-SIE-Engine` pins the inference engine (a hidden operator header; the SDK never sends it). This gateway fronts
# one engine, the Triton Python-backend engine in engine/, so "triton" is the only value it knows; any other is a
# client error rather than a silent fall-through to an engine the operator did not ask for.
KNOWN_ENGINES = ("triton",)


def parse_engine_pin(value: str | None) -> str | None:
    if value is None:
        return None
    if value not in KNOWN_ENGINES:
        raise InvalidRequest(f"X-SIE-Engine must be one of: {', '.join(KNOWN_ENGINES)}", param="X-SIE-Engine")
    return value


def parse_remote(values: list[str] | None) -> bool:
    if not values:
        return False
    if len(values) != 1 or values[0] != "forbid":
        raise InvalidRequest("X-SIE-Remote accepts only one value: 'forbid'", param="X-SIE-Remote")
    return True


def _rendezvous_score(key: str, endpoint: Endpoint) -> int:
    digest = hashlib.blake2b(f"{key}|{endpoint.config.url}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "big")


class Router:
    def __init__(self, registry: ModelRegistry) -> None:
        self.registry = registry

    def check_pool(self, hints: RoutingHints) -> None:
        """A named pool must be configured (404) and hold at least one endpoint (503 pool capacity)."""
        if hints.pool is None:
            return
        pool = next((p for p in self.registry.settings.pools if p.name == hints.pool), None)
        if pool is None:
            raise NotFound(f"pool '{hints.pool}' not found", param="pool")
        if not pool.endpoints and not pool.dns:  # a DNS pool with no address yet is provisioning, below
            raise PoolCapacityUnavailable(f"pool '{hints.pool}' has no capacity (zero endpoints configured)")

    def candidates(self, profile: ModelProfile, hints: RoutingHints) -> list[Endpoint]:
        """Endpoints to try, best first (the rest are fallbacks for failures before the first token)."""
        endpoints = self.registry.endpoints
        self.check_pool(hints)
        if hints.pool is not None:
            endpoints = [e for e in endpoints if e.pool.name == hints.pool]
        if hints.machine_profile is not None:
            endpoints = [e for e in endpoints if e.pool.machine_profile == hints.machine_profile]
            if not endpoints:
                raise MachineProfileNotConfigured(
                    f"machine profile {quoted(hints.machine_profile)} is not configured on this gateway",
                    param="X-SIE-MACHINE-PROFILE",
                )
        serving = [e for e in endpoints if profile.name in e.models or profile.triton_model in e.not_ready]
        if hints.forbid_remote:
            local = [e for e in serving if not e.config.remote]
            # an unreachable local endpoint may serve it once back: that is 503, not a client error
            unreachable_local = any(not e.config.remote and not e.healthy for e in endpoints)
            if serving and not local and not unreachable_local:
                raise InvalidRequest(
                    "X-SIE-Remote: forbid, but this model is only served remotely", param="X-SIE-Remote"
                )
            serving = local
        healthy = [e for e in serving if e.healthy and profile.name in e.models]
        if not healthy:
            if hints.forbid_remote:  # the contract's "no verified local worker": retryable, Retry-After 5
                raise Unavailable("no healthy local endpoint serves this model", retry_after=5)
            raise self.registry.provisioning(
                f"no healthy endpoint serves '{profile.name}' in the selected pool; provisioning in progress")
        if hints.affinity_key:
            return sorted(healthy, key=lambda e: _rendezvous_score(hints.affinity_key or "", e), reverse=True)
        random.shuffle(healthy)  # ties between equally loaded endpoints spread evenly
        return sorted(healthy, key=lambda e: e.outstanding)
