"""The waiting queue's policy: which waiting sequence goes next, which running one gives way first, and whether a
waiting one may take a running one's place.

- `fcfs` (the default, vLLM's): arrival order. A preempted candidate goes back to its place by arrival, which is
  the front (everything still waiting arrived after it was admitted). Nothing waiting outranks anything running.
- `priority` (vLLM's `--scheduling-policy priority`): by (priority, arrival), lower first. A waiting request of a
  strictly better priority outranks a running one: the scheduler preempts the worst running (the newest among
  equals) for it when the batch or the blocks are full. Equal or lower priority never preempts.
- `fair`: the Virtual Token Counter (Sheng et al., "Fairness in Serving Large Language Models", OSDI 2024), in
  engine.core.fair_share.

The scheduler admits from the head and stops at the first that does not fit, so a large request is never starved
by a stream of small ones of the same rank.
"""

from __future__ import annotations

import bisect
from collections.abc import Iterator
from typing import Protocol

from engine.core.sequence import Sequence, SequenceGroup

Rank = tuple[float, ...]


class WaitingPolicy(Protocol):
    """What the scheduler asks of its waiting queue (FcfsQueue documents each call)."""

    name: str

    def rank(self, seq: Sequence) -> Rank: ...
    def victim(self, running: list[Sequence]) -> Sequence | None: ...
    def outranks(self, waiting: Sequence, victim: Sequence, running: list[Sequence]) -> bool: ...
    def add(self, seq: Sequence) -> None: ...
    def add_preempted(self, seq: Sequence) -> None: ...
    def charge(self, seq: Sequence, prompt_tokens: int, output_tokens: int) -> None: ...
    def done(self, group: SequenceGroup) -> None: ...
    def peek(self) -> Sequence | None: ...
    def pop(self) -> Sequence: ...
    def remove(self, seq: Sequence) -> None: ...
    def __contains__(self, seq: object) -> bool: ...
    def __iter__(self) -> Iterator[Sequence]: ...
    def __len__(self) -> int: ...


def arrival(seq: Sequence) -> Rank:
    return (seq.group.order, seq.index)


class FcfsQueue:
    """Sequences kept sorted by `rank` (arrival here; a subclass ranks otherwise)."""

    name = "fcfs"

    def __init__(self) -> None:
        self._queue: list[tuple[Rank, Sequence]] = []

    def rank(self, seq: Sequence) -> Rank:
        """The order of the queue, and of the running batch: the last running one gives way first when the blocks
        run out. A rank never changes while a request is in flight, so the first running one always progresses
        (a rank that moved, such as a tenant's service, could preempt each in turn and finish none)."""
        return arrival(seq)

    def victim(self, running: list[Sequence]) -> Sequence | None:
        """The running sequence (in rank order) a waiting one that outranks it would replace."""
        return running[-1] if running else None

    def outranks(self, waiting: Sequence, victim: Sequence, running: list[Sequence]) -> bool:
        """Whether `waiting` may take the place of `victim`, one of the `running`, when there is no room for
        both (preempting it)."""
        return False

    def add(self, seq: Sequence) -> None:
        """A new request's first candidate: in its place by rank."""
        bisect.insort_right(self._queue, (self.rank(seq), seq), key=lambda entry: entry[0])

    def add_preempted(self, seq: Sequence) -> None:
        """A preempted candidate: back in its place by rank."""
        self.add(seq)

    def charge(self, seq: Sequence, prompt_tokens: int, output_tokens: int) -> None:
        """Service a running sequence received (the fair policy counts it)."""

    def done(self, group: SequenceGroup) -> None:
        """A request has ended."""

    def peek(self) -> Sequence | None:
        return self._queue[0][1] if self._queue else None

    def pop(self) -> Sequence:
        return self._queue.pop(0)[1]

    def remove(self, seq: Sequence) -> None:
        self._queue = [entry for entry in self._queue if entry[1] is not seq]

    def __contains__(self, seq: object) -> bool:
        return any(entry[1] is seq for entry in self._queue)

    def __iter__(self) -> Iterator[Sequence]:
        return iter([seq for _, seq in self._queue])

    def __len__(self) -> int:
        return len(self._queue)


class PriorityQueue(FcfsQueue):
    name = "priority"

    def rank(self, seq: Sequence) -> Rank:
        return (seq.group.request.priority, *arrival(seq))

    def outranks(self, waiting: Sequence, victim: Sequence, running: list[Sequence]) -> bool:
        return waiting.group.request.priority < victim.group.request.priority
