"""The per-key limiter on an injected clock: concurrent slots, tokens per minute over a sliding window, and the 429's
Retry-After and x-ratelimit-* headers."""

from __future__ import annotations

import pytest

from gateway.key_settings import KeyPolicy
from gateway.rate_limits import RateLimited, RateLimiter, format_duration


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def clock() -> Clock:
    return Clock()


def test_concurrency_limit_refuses_past_the_limit_until_a_slot_is_released(clock):
    limiter, policy = RateLimiter(clock), KeyPolicy(max_concurrent=2)
    limiter.acquire("k", policy)
    limiter.acquire("k", policy)
    with pytest.raises(RateLimited) as raised:
        limiter.acquire("k", policy)
    err = raised.value
    assert (err.status, err.code, err.type) == (429, "rate_limit_exceeded", "requests")
    headers = err.headers()
    assert headers["Retry-After"] == "1"
    assert headers["x-ratelimit-limit-requests"] == "2" and headers["x-ratelimit-remaining-requests"] == "0"
    limiter.acquire("other-key", policy)  # another key has its own slots
    limiter.release("k")
    limiter.acquire("k", policy)
    assert limiter.in_flight("k") == 2


def test_release_never_goes_below_zero_and_forgets_idle_keys(clock):
    limiter, policy = RateLimiter(clock), KeyPolicy(max_concurrent=1)
    limiter.release("k")  # nothing held: nothing changes
    limiter.acquire("k", policy)
    limiter.release("k")
    limiter.release("k")
    assert limiter.in_flight("k") == 0 and not limiter._usage
    limiter.acquire("k", policy)  # one slot, free again
    assert limiter.in_flight("k") == 1


def test_tokens_per_minute_retry_after_is_when_enough_tokens_leave_the_window(clock):
    limiter, policy = RateLimiter(clock), KeyPolicy(tpm=1000)
    limiter.charge("k", policy, 600)  # t = 0
    clock.now += 10
    headers = limiter.charge("k", policy, 300)  # t = 10
    assert headers == {"x-ratelimit-limit-tokens": "1000", "x-ratelimit-remaining-tokens": "100",
                       "x-ratelimit-reset-tokens": "50s"}
    clock.now += 20.5  # t = 30.5: 900 counted, 200 more do not fit until the first 600 leave at t = 60
    with pytest.raises(RateLimited) as raised:
        limiter.charge("k", policy, 200)
    err = raised.value
    assert (err.status, err.code, err.type) == (429, "rate_limit_exceeded", "tokens")
    assert err.headers()["Retry-After"] == "30"  # 29.5 s, rounded up: a retry before then would fail again
    assert err.headers()["x-ratelimit-remaining-tokens"] == "100"
    assert err.headers()["x-ratelimit-reset-tokens"] == "30s"
    clock.now = 1059.9  # t = 59.9: not yet
    with pytest.raises(RateLimited):
        limiter.charge("k", policy, 200)
    clock.now = 1060.0  # t = 60: the first charge left the window
    limiter.charge("k", policy, 200)


def test_a_refused_charge_counts_nothing_and_the_wait_covers_several_charges(clock):
    limiter, policy = RateLimiter(clock), KeyPolicy(tpm=100)
    for _ in range(4):  # 25 tokens at t = 0, 5, 10, 15
        limiter.charge("k", policy, 25)
        clock.now += 5
    # t = 20: 100 counted; 60 fit once the first three charges (75) have left: at t = 70
    with pytest.raises(RateLimited) as raised:
        limiter.charge("k", policy, 60)
    assert raised.value.headers()["Retry-After"] == "50"
    clock.now += 50
    limiter.charge("k", policy, 60)


def test_a_request_larger_than_the_limit_is_refused_without_retry_after(clock):
    limiter = RateLimiter(clock)
    with pytest.raises(RateLimited) as raised:
        limiter.charge("k", KeyPolicy(tpm=100), 101)
    headers = raised.value.headers()
    assert "Retry-After" not in headers and headers["x-ratelimit-limit-tokens"] == "100"
    assert not limiter._usage


def test_a_key_without_limits_is_never_refused(clock):
    limiter, policy = RateLimiter(clock), KeyPolicy()
    for _ in range(1000):
        limiter.acquire("k", policy)
        assert limiter.charge("k", policy, 10**9) == {}


@pytest.mark.parametrize(("seconds", "text"), [(0.25, "250ms"), (0.0, "0ms"), (1.0, "1s"), (59.2, "1m0s"),
                                               (360.0, "6m0s"), (61.5, "1m2s")])
def test_reset_durations_in_openai_form(seconds, text):
    assert format_duration(seconds) == text
