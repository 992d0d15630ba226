"""The worker's drain on SIGTERM: readiness fails at once, open generations run on until a deadline, then end.

uvicorn stops accepting and closes idle connections itself; what it cannot do is end a response: gunicorn's
master SIGKILLs the worker at `graceful_timeout`, cutting a stream with no ending. So the deadline falls a little
before that, and each generation still open then ends with `server_shutting_down`: an in-band error event and
`[DONE]` on a stream, a 503 with `Retry-After` on a blocking request.
"""

from __future__ import annotations

import asyncio
import logging
import time

from gateway.errors import Unavailable

log = logging.getLogger(__name__)


class ShuttingDown(Unavailable):
    code = "server_shutting_down"

    def __init__(self) -> None:
        super().__init__("the server is shutting down; retry the request", retry_after=1)


class DeadlineWait:
    """A generation's wait for its next event, which the drain deadline ends early (no task per token)."""

    def __init__(self) -> None:
        self.timeout: asyncio.Timeout | None = None  # the `asyncio.timeout` of the wait in progress
        self.cut_short = False

    def cut(self) -> None:
        self.cut_short = True
        if self.timeout is not None:
            try:
                self.timeout.reschedule(asyncio.get_running_loop().time())  # fires now
            except RuntimeError:  # that wait has just finished; the caller checks `cut_short` next
                pass

    def check(self) -> None:
        if self.cut_short:
            raise ShuttingDown()


def deadline_for(graceful_s: float) -> float:
    """When open generations end, in seconds after SIGTERM: time left to write the ending and exit."""
    return max(graceful_s - min(2.0, graceful_s / 4), 0.0)


class Drain:
    """One per worker process (the app's); the worker's signal handler calls `begin`."""

    def __init__(self) -> None:
        self.draining = False
        self.deadline_passed = False
        self.started_at: float | None = None
        self._open: set[DeadlineWait] = set()

    def track(self) -> DeadlineWait:
        """A new generation's wait; `untrack` it when the generation ends."""
        wait = DeadlineWait()
        if self.deadline_passed:
            wait.cut_short = True
        self._open.add(wait)
        return wait

    def untrack(self, wait: DeadlineWait) -> None:
        self._open.discard(wait)

    def begin(self, graceful_s: float) -> None:
        """Start draining (on the event loop): open generations end in `deadline_for(graceful_s)` seconds."""
        if self.draining:
            return
        self.draining, self.started_at = True, time.monotonic()
        delay = deadline_for(graceful_s)
        log.info("draining: %d generations open; those still open in %.1f s end with server_shutting_down",
                 len(self._open), delay)
        asyncio.get_running_loop().call_later(delay, self._deadline)

    def _deadline(self) -> None:
        self.deadline_passed = True
        if self._open:
            log.warning("drain deadline: ending %d open generations with server_shutting_down", len(self._open))
        for wait in list(self._open):
            wait.cut()
