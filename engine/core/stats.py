"""What the engine measures for its metrics (torch-free): gauges set each step, monotonic counters, and
per-request timings that the Triton glue drains into histograms (engine/triton/metrics.py).

Written by the engine thread, read by the metrics thread: plain ints, a dict replaced only by whole-value
updates, and deques (thread-safe append / popleft) that keep at most `MAX_PENDING` timings each when nobody
drains them (the engine run in process, without Triton).
"""

from __future__ import annotations

import collections
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

# histogram name -> what it times (seconds); vLLM's names for the same things
TIMINGS = (
    "time_to_first_token",  # arrival in the engine -> first sampled token
    "inter_token_latency",  # between consecutive tokens of one candidate
    "e2e_request_latency",  # arrival -> the request's end
    "request_queue_time",  # arrival -> admission to the running batch
    "request_prefill_time",  # admission -> first token
)
FINISH_REASONS = ("stop", "length", "error", "cancelled")
PREEMPTION_CAUSES = ("kv", "priority")  # the blocks ran out; a waiting request outranked it (priority or fair)
PRIORITY_BANDS = ("high", "default", "low")  # priority < 0, = 0, > 0: a bounded label for any priority
MAX_PENDING = 65536


def priority_band(priority: int) -> str:
    return "high" if priority < 0 else "default" if priority == 0 else "low"


def _timings() -> dict[str, collections.deque[float]]:
    return {name: collections.deque(maxlen=MAX_PENDING) for name in TIMINGS}


@dataclass
class EngineStats:
    running: int = 0  # requests with a candidate in the running batch (computing its prompt or decoding)
    kv_used: int = 0  # KV blocks held by running requests, each shared block once (engine.core.kv_manager)
    kv_budget: int = 1  # KV blocks in all
    preemptions: int = 0  # running candidates preempted for KV room (computed again later)
    prompt_tokens: int = 0
    generation_tokens: int = 0
    cancelled: int = 0
    prefix_queries: int = 0  # tokens looked up in the prefix cache, at every admission (a preempted one's return too)
    prefix_hits: int = 0  # of those, tokens found there (never more than the queries)
    finished: dict[str, int] = field(default_factory=lambda: dict.fromkeys(FINISH_REASONS, 0))
    preemptions_by_cause: dict[str, int] = field(default_factory=lambda: dict.fromkeys(PREEMPTION_CAUSES, 0))
    # requests by priority band, running and waiting (a request counts once, in the band of its priority)
    running_by_band: dict[str, int] = field(default_factory=lambda: dict.fromkeys(PRIORITY_BANDS, 0))
    waiting_by_band: dict[str, int] = field(default_factory=lambda: dict.fromkeys(PRIORITY_BANDS, 0))
    timings: dict[str, collections.deque[float]] = field(default_factory=_timings)

    @property
    def kv_usage(self) -> float:
        return min(1.0, self.kv_used / self.kv_budget) if self.kv_budget else 0.0

    def count_bands(self, running: Iterable[Any], waiting: Iterable[Any]) -> None:
        """Requests running and waiting by priority band, from their sequences (each request once)."""
        for attr, seqs in (("running_by_band", running), ("waiting_by_band", waiting)):
            groups = {id(seq.group): seq.group for seq in seqs}.values()
            counts = dict.fromkeys(PRIORITY_BANDS, 0)
            for group in groups:
                counts[priority_band(group.request.priority)] += 1
            setattr(self, attr, counts)  # one whole-value update: the metrics thread reads it

    def observe(self, timing: str, seconds: float) -> None:
        self.timings[timing].append(max(seconds, 0.0))

    def finish(self, reason: str) -> None:
        self.finished[reason] = self.finished.get(reason, 0) + 1

    def drain(self, timing: str) -> list[float]:
        """The timings observed since the last drain, oldest first."""
        queue, out = self.timings[timing], []
        while True:
            try:
                out.append(queue.popleft())
            except IndexError:
                return out
