"""Rate-limited cancellation checks for the Triton glue.

`InferenceRequest.is_cancelled()` is a round trip from the stub process to the Triton server (the stub
enqueues a message and waits for the answer), and the scheduler asks every running request at every step.
Asking at most every `interval_s` keeps that off the decode path; a cancelled request is still freed
within one interval, and once cancelled it stays cancelled.
"""

from __future__ import annotations

import time
from collections.abc import Callable


class CancelProbe:
    def __init__(self, check: Callable[[], bool], interval_s: float = 0.05,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self._check = check
        self._interval = interval_s
        self._clock = clock
        self._next_at = 0.0
        self._cancelled = False

    def __call__(self) -> bool:
        if self._cancelled:
            return True
        now = self._clock()
        if now >= self._next_at:
            self._next_at = now + self._interval
            self._cancelled = bool(self._check())
        return self._cancelled
