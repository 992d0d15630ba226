"""Per-key limits (docs/auth.md, "Per-key limits and priorities"): requests in flight at once, and tokens per minute
over a sliding 60 s window. The counts live in this gateway worker process: each worker enforces the whole limit on
its own (a shared store would cost a round trip on every request), so N workers admit up to N times the limit.

The clock is injected so that the window can be tested without sleeping.
"""

from __future__ import annotations

import math
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

from gateway.errors import GatewayError
from gateway.key_settings import KeyPolicy

WINDOW_S = 60.0
# a slot frees when any request of the key ends, which nothing predicts: a short wait, as the engine's QUEUE_FULL
CONCURRENCY_RETRY_AFTER_S = 1


class RateLimited(GatewayError):
    """429 in OpenAI's shape: code `rate_limit_exceeded`, type `requests` (concurrency) or `tokens` (tpm), with
    `Retry-After` and the `x-ratelimit-*` headers that apply."""

    status = 429
    code = "rate_limit_exceeded"

    def __init__(self, message: str, *, kind: str, retry_after: float | None, limit_headers: dict[str, str]) -> None:
        super().__init__(message, retry_after=retry_after)
        self.type = kind
        self.limit_headers = limit_headers

    def headers(self) -> dict[str, str]:
        return {**super().headers(), **self.limit_headers}


@dataclass
class _Usage:
    in_flight: int = 0
    charges: deque[tuple[float, int]] = field(default_factory=deque)  # (when, tokens), oldest first
    charged: int = 0  # the sum of `charges`


class RateLimiter:
    """The counts of every limited key, by its key id (a keyed hash, never the key)."""

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self._clock = clock
        self._usage: dict[str, _Usage] = {}

    def acquire(self, key_id: str, policy: KeyPolicy) -> None:
        """Take one of the key's concurrent slots, or raise RateLimited. The caller releases it exactly once."""
        limit = policy.max_concurrent
        if limit is None:
            return
        usage = self._usage.setdefault(key_id, _Usage())
        if usage.in_flight >= limit:
            raise RateLimited(f"too many requests in flight for this key: the limit is {limit} at once",
                              kind="requests", retry_after=CONCURRENCY_RETRY_AFTER_S,
                              limit_headers=_request_headers(limit, 0))
        usage.in_flight += 1

    def release(self, key_id: str) -> None:
        usage = self._usage.get(key_id)
        if usage is None or usage.in_flight == 0:
            return
        usage.in_flight -= 1
        self._forget_idle(key_id, usage)

    def charge(self, key_id: str, policy: KeyPolicy, tokens: int) -> dict[str, str]:
        """Count `tokens` against the key's tokens per minute, or raise RateLimited (then nothing is counted).
        Returns the `x-ratelimit-*` headers of the key after the charge ({} for a key without limits)."""
        limit = policy.tpm
        if limit is None:
            return self._concurrency_headers(key_id, policy)
        now = self._clock()
        usage = self._usage.setdefault(key_id, _Usage())
        self._expire(usage, now)
        if tokens > limit:  # no wait makes it fit: no Retry-After
            self._forget_idle(key_id, usage)
            raise RateLimited(f"this request needs about {tokens} tokens, more than the key's limit of {limit} "
                              "tokens per minute", kind="tokens", retry_after=None,
                              limit_headers=self._token_headers(usage, limit, now))
        if usage.charged + tokens > limit:
            wait = self._wait_for(usage, limit - tokens, now)
            headers = self._token_headers(usage, limit, now)
            self._forget_idle(key_id, usage)
            raise RateLimited(f"the key's limit of {limit} tokens per minute is used up: {usage.charged} counted in "
                              f"the last {WINDOW_S:g} s, this request needs about {tokens}", kind="tokens",
                              retry_after=math.ceil(wait), limit_headers=headers)
        usage.charges.append((now, tokens))
        usage.charged += tokens
        return {**self._concurrency_headers(key_id, policy), **self._token_headers(usage, limit, now)}

    def in_flight(self, key_id: str) -> int:
        usage = self._usage.get(key_id)
        return usage.in_flight if usage is not None else 0

    def _concurrency_headers(self, key_id: str, policy: KeyPolicy) -> dict[str, str]:
        if policy.max_concurrent is None:
            return {}
        return _request_headers(policy.max_concurrent, policy.max_concurrent - self.in_flight(key_id))

    @staticmethod
    def _expire(usage: _Usage, now: float) -> None:
        while usage.charges and usage.charges[0][0] <= now - WINDOW_S:
            usage.charged -= usage.charges.popleft()[1]

    @staticmethod
    def _wait_for(usage: _Usage, allowed: int, now: float) -> float:
        """Seconds until no more than `allowed` tokens are left in the window (charges leave it oldest first)."""
        left = usage.charged
        for when, tokens in usage.charges:
            left -= tokens
            if left <= allowed:
                return when + WINDOW_S - now
        return WINDOW_S  # not reached: `allowed` >= 0 and the window empties completely

    def _token_headers(self, usage: _Usage, limit: int, now: float) -> dict[str, str]:
        reset = usage.charges[0][0] + WINDOW_S - now if usage.charges else 0.0
        return {"x-ratelimit-limit-tokens": str(limit),
                "x-ratelimit-remaining-tokens": str(max(limit - usage.charged, 0)),
                "x-ratelimit-reset-tokens": format_duration(reset)}

    def _forget_idle(self, key_id: str, usage: _Usage) -> None:
        """Drop a key's entry once it holds nothing, so keys that come and go leave no state behind."""
        if usage.in_flight == 0 and not usage.charges:
            self._usage.pop(key_id, None)


def _request_headers(limit: int, remaining: int) -> dict[str, str]:
    return {"x-ratelimit-limit-requests": str(limit), "x-ratelimit-remaining-requests": str(max(remaining, 0))}


def format_duration(seconds: float) -> str:
    """OpenAI's form of `x-ratelimit-reset-*`: `1s`, `6m0s`, `250ms`."""
    if seconds < 1:
        return f"{max(math.ceil(seconds * 1000), 0)}ms"
    whole = math.ceil(seconds)
    minutes, rest = divmod(whole, 60)
    return f"{minutes}m{rest}s" if minutes else f"{rest}s"
