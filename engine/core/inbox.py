"""The engine's inbox: requests submitted from any thread wait here until the loop thread takes them.

It also decides how long an idle engine waits before its first step. Requests from concurrent clients do not arrive
together. Eight streams opened at once reach the engine over 5-12 ms, one every millisecond or two, because each passes
through the client, the gateway and Triton in turn. An idle engine that stepped on the first arrival prefilled that
request alone (30-80 ms of forward on the CPU). The other seven waited for that step and then prefilled together. Their
first tokens came a whole extra step later, and the median TTFT moved by a third with the arrival order (measured on the
served stack, eight streams opened at once). So an idle engine that gets a request gathers the burst: it waits while
requests keep arriving, until none arrives for `quiet_s` or `window_s` has passed since the first. This is the idea of
Triton's dynamic batcher (`max_queue_delay_microseconds`). A lone request pays `quiet_s` once, and a busy engine never
waits, since new arrivals join its next step anyway.
"""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Iterator

from engine.errors import QueueFull
from engine.request import EngineRequest


class Inbox:
    def __init__(self, window_s: float = 0.0, quiet_s: float = 0.0) -> None:
        self.window_s = window_s  # the longest an idle engine waits for a burst to end (0: it never waits)
        self.quiet_s = quiet_s  # a burst ends when no request has arrived for this long
        self._incoming: queue.SimpleQueue[EngineRequest] = queue.SimpleQueue()
        self._pending = 0  # put and not yet taken
        self._lock = threading.Lock()
        self._arrived = threading.Event()

    @property
    def pending(self) -> int:
        return self._pending

    def put(self, request: EngineRequest, room: int) -> None:
        """Queue a request; raises QueueFull at once when `room` requests (what the queue bound leaves past the
        inbox) are already pending here."""
        with self._lock:
            if self._pending >= room:
                raise QueueFull()
            self._pending += 1
        self._incoming.put(request)
        self._arrived.set()

    def take(self) -> Iterator[EngineRequest]:
        """The requests put and not yet taken, each counted off the pending total."""
        while True:
            try:
                request = self._incoming.get_nowait()
            except queue.Empty:
                return
            with self._lock:
                self._pending -= 1
            yield request

    def wait(self, timeout: float) -> None:
        """Sleep until a request arrives (or `wake` is called), at most `timeout` seconds."""
        self._arrived.wait(timeout)
        self._arrived.clear()

    def wake(self) -> None:
        """End a `wait` now (the loop is stopping)."""
        self._arrived.set()

    def gather_burst(self) -> None:
        """Return once the requests arriving together are in (see the module docstring), or at once when
        the window is 0. The loop takes them afterwards."""
        deadline = time.monotonic() + self.window_s
        while (left := deadline - time.monotonic()) > 0:
            if not self._arrived.wait(min(self.quiet_s, left)):
                return  # quiet: the burst is over
            self._arrived.clear()
