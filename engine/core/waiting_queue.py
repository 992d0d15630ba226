"""The waiting queue's policy: which waiting sequence the scheduler tries next.

First come, first served, as vLLM's default: new requests in arrival order, and a preempted candidate at the front
(it arrived before anything still waiting). The scheduler admits from the head and stops at the first that does
not fit, so a large request is never starved by a stream of small ones. Another policy (priorities) orders the
same queue differently behind the same four calls.
"""

from __future__ import annotations

import collections
from collections.abc import Iterator

from engine.core.sequence import Sequence


class FcfsQueue:
    def __init__(self) -> None:
        self._queue: collections.deque[Sequence] = collections.deque()

    def add(self, seq: Sequence) -> None:
        """A new request's first candidate."""
        self._queue.append(seq)

    def add_preempted(self, seq: Sequence) -> None:
        self._queue.appendleft(seq)

    def peek(self) -> Sequence | None:
        return self._queue[0] if self._queue else None

    def pop(self) -> Sequence:
        return self._queue.popleft()

    def remove(self, seq: Sequence) -> None:
        self._queue.remove(seq)

    def __contains__(self, seq: object) -> bool:
        return seq in self._queue

    def __iter__(self) -> Iterator[Sequence]:
        return iter(list(self._queue))

    def __len__(self) -> int:
        return len(self._queue)
