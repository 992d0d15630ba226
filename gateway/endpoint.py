"""A Triton endpoint as the gateway routes to it, and one request's claim on it (its in-flight count)."""

from __future__ import annotations

from collections.abc import AsyncGenerator
from dataclasses import dataclass, field
from types import TracebackType

from gateway.domain import GenerationEvent
from gateway.profile import ModelProfile
from gateway.settings import EndpointConfig, PoolConfig
from gateway.triton.client import TritonClient


@dataclass
class Endpoint:
    config: EndpointConfig
    pool: PoolConfig
    client: TritonClient
    healthy: bool = False
    models: dict[str, ModelProfile] = field(default_factory=dict)  # canonical id -> profile
    not_ready: set[str] = field(default_factory=set)  # Triton names still loading / unavailable
    loading: set[str] = field(default_factory=set)  # of those, the ones Triton is loading now
    # Triton name -> profile of a model whose process died: out of service until the supervisor restores it
    withdrawn: dict[str, ModelProfile] = field(default_factory=dict)
    # requests running here: the router's least-loaded choice, and a retired endpoint is closed only at 0.
    # Changed by InFlight alone.
    outstanding: int = 0
    discovered: bool = False  # came from the pool's DNS source (dropped when its address goes)

    @property
    def name(self) -> str:
        return self.config.name or self.config.url


class InFlight:
    """One request's stream on one endpoint, counted in `endpoint.outstanding` from entry until `release()`.

    `async with InFlight(endpoint, stream) as claim:` takes the count; leaving the block releases it (and closes the
    stream) on every path, unless `hand_over()` passed it to a longer-lived owner (a generation session), which then
    calls `release()`. Releasing twice is harmless, so every owner can release on its own way out."""

    __slots__ = ("endpoint", "stream", "_state", "_handed_over")

    def __init__(self, endpoint: Endpoint, stream: AsyncGenerator[GenerationEvent, None]) -> None:
        self.endpoint = endpoint
        self.stream = stream
        self._state = "new"  # -> "held" -> "released", once each
        self._handed_over = False

    async def __aenter__(self) -> InFlight:
        if self._state != "new":
            raise RuntimeError("a claim is taken once")
        self._state = "held"
        self.endpoint.outstanding += 1
        return self

    async def __aexit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                        tb: TracebackType | None) -> None:
        if not self._handed_over:
            await self.release()

    def hand_over(self) -> InFlight:
        """The block no longer releases it: the caller that keeps it must."""
        self._handed_over = True
        return self

    async def release(self) -> None:
        """Give the count back, then close the stream (which cancels the Triton call when it still runs)."""
        if self._state != "held":
            return
        self._state = "released"
        # the count first: closing the stream awaits, and a cancellation there must not leave the count taken
        self.endpoint.outstanding -= 1
        await self.stream.aclose()

    @property
    def held(self) -> bool:
        return self._state == "held"
