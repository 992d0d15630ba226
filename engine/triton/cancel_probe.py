"""Rate-limited cancellation checks for the Triton glue.

`InferenceRequest.is_cancelled()` is a round trip from the stub process to the Triton server (the stub
enqueues a message and waits for the answer, holding the GIL), and the scheduler asks every request it holds
at every step. So each request asks the server at most once per interval, and once cancelled it stays
cancelled.

A request the gateway stops (contract/stop_call.py) is cancelled at once, with no round trip: its probe is found
by the gateway's call id in `CallStops`.

The interval grows with the number of live requests (`ProbeRate`), so that all of a model's round trips
together stay under a fixed rate. With a fixed 50 ms interval the probes took 7.6 % of the engine loop
thread's samples on the served stack at 16 streams (py-spy); at 50 round trips a second in all 4.2 %, at 20
a second 2.8 %: a round trip waits for the server to be scheduled on a busy box. At 20 a second a request is
asked every max(0.1 s, live / 20): 0.1 s alone, 0.8 s at 16 live, 3.2 s with 64 running. The gateway ends
the client's side at once when it disconnects; this bounds how long the engine keeps generating for a client
that has gone.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable


class ProbeRate:
    """One model's budget: `rate_per_s` round trips a second in all, shared by its `live()` requests."""

    def __init__(self, live: Callable[[], int], rate_per_s: float = 20.0, min_interval_s: float = 0.1) -> None:
        self.live = live
        self.rate = rate_per_s
        self.min_interval = min_interval_s

    def interval(self) -> float:
        return max(self.min_interval, self.live() / self.rate)


class CancelProbe:
    def __init__(self, check: Callable[[], bool], rate: ProbeRate,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self._check = check
        self._rate = rate
        self._clock = clock
        self._next_at = 0.0
        self._cancelled = False

    def stop(self) -> None:
        self._cancelled = True

    def __call__(self) -> bool:
        if self._cancelled:
            return True
        now = self._clock()
        if now >= self._next_at:
            self._next_at = now + self._rate.interval()
            self._cancelled = bool(self._check())
        return self._cancelled


class CallStops:
    """The live requests' probes by the gateway's call id, so that a stop request finds the one it names. Filled
    by the thread that takes requests in, emptied by the one that sends their final responses."""

    def __init__(self) -> None:
        self._probes: dict[str, CancelProbe] = {}
        self._lock = threading.Lock()

    def add(self, call_id: str, probe: CancelProbe) -> None:
        with self._lock:
            self._probes[call_id] = probe

    def stop(self, call_id: str) -> bool:
        """Whether a live request had that id (one that already ended, or never came, is nothing to stop)."""
        with self._lock:
            probe = self._probes.get(call_id)
        if probe is not None:
            probe.stop()
        return probe is not None

    def discard(self, call_id: str | None) -> None:
        with self._lock:
            self._probes.pop(call_id, None)  # type: ignore[arg-type]

    def __len__(self) -> int:
        return len(self._probes)
