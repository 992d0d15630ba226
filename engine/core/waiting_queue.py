"""The waiting queue's policy: which waiting sequence goes next, which running one gives way first, and whether a
waiting one may take a running one's place.

- `fcfs` (the default, vLLM's): arrival order. Nothing waiting outranks anything running.
- `priority` (vLLM's `--scheduling-policy priority`): by (priority, arrival), lower first. A waiting request of a
  strictly better priority outranks a running one: the scheduler preempts the worst running (the newest among
  equals) for it when the batch or the blocks are full. Equal or lower priority never preempts.
- `fair`: the Virtual Token Counter (Sheng et al., "Fairness in Serving Large Language Models", OSDI 2024), in
  engine.core.fair_share.

Within a rank's band (every request under fcfs, one priority under priority), requests still waiting for their
first token go before preempted candidates that have already streamed: a client waiting on its first token sees
nothing at all (and the gateway's first-chunk timeout runs), while a preempted stream only pauses (it is sent a
heartbeat). vLLM puts the preempted first; under a chat load four times the KV pool that kept new turns more than two
minutes behind preempted thousand-token answers. A preempted candidate is passed over by new requests at most
BYPASS_LIMIT times, then it is due and goes first, so it is never starved.

The scheduler admits from the head and stops at the first that does not fit, so a large request is never starved
by a stream of small ones.
"""

from __future__ import annotations

import bisect
from collections.abc import Iterator
from typing import Protocol

from engine.core.sequence import Sequence, SequenceGroup

Rank = tuple[float, ...]
BYPASS_LIMIT = 64  # new requests admitted past a preempted candidate before it is due


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


def streamed(seq: Sequence) -> bool:
    """A preempted candidate whose client has tokens already (a new prompt, or one preempted before its first
    token, has none)."""
    return bool(seq.output_ids)


class FcfsQueue:
    """Sequences kept in queue order: rank's band, new before streamed (unless due), then arrival. A subclass
    chooses the band."""

    name = "fcfs"

    def __init__(self) -> None:
        self._queue: list[tuple[Rank, Sequence]] = []
        self._passed: dict[int, int] = {}  # id of a waiting streamed candidate -> new requests admitted past it

    def band(self, seq: Sequence) -> Rank:
        """What ranks before arrival (nothing under fcfs)."""
        return ()

    def rank(self, seq: Sequence) -> Rank:
        """The order of the running batch: the last running one gives way first when the blocks run out. A rank
        never changes while a request is in flight, so the first running one always progresses (a rank that moved,
        such as a tenant's service, could preempt each in turn and finish none)."""
        return (*self.band(seq), *arrival(seq))

    def _key(self, seq: Sequence) -> Rank:
        behind = streamed(seq) and self._passed.get(id(seq), 0) < BYPASS_LIMIT
        return (*self.band(seq), int(behind), *arrival(seq))

    def victim(self, running: list[Sequence]) -> Sequence | None:
        """The running sequence (in rank order) a waiting one that outranks it would replace."""
        return running[-1] if running else None

    def outranks(self, waiting: Sequence, victim: Sequence, running: list[Sequence]) -> bool:
        """Whether `waiting` may take the place of `victim`, one of the `running`, when there is no room for
        both (preempting it)."""
        return False

    def add(self, seq: Sequence) -> None:
        """A new request's first candidate, or a preempted one: in its place in queue order."""
        bisect.insort_right(self._queue, (self._key(seq), seq), key=lambda entry: entry[0])

    def add_preempted(self, seq: Sequence) -> None:
        self.add(seq)

    def charge(self, seq: Sequence, prompt_tokens: int, output_tokens: int) -> None:
        """Service a running sequence received (the fair policy counts it)."""

    def done(self, group: SequenceGroup) -> None:
        """A request has ended."""

    def head_key(self) -> Rank | None:
        return self._queue[0][0] if self._queue else None

    def peek(self) -> Sequence | None:
        return self._queue[0][1] if self._queue else None

    def pop(self) -> Sequence:
        seq = self._queue.pop(0)[1]
        self._passed.pop(id(seq), None)
        if not streamed(seq):
            self._count_passes(self.band(seq))
        return seq

    def _count_passes(self, band: Rank) -> None:
        """A new request was admitted: every streamed candidate of its band still waiting was passed once more;
        one that is now due moves up to its place by arrival."""
        due = False
        for _, seq in self._queue:
            if streamed(seq) and self.band(seq) == band:
                self._passed[id(seq)] = self._passed.get(id(seq), 0) + 1
                due |= self._passed[id(seq)] == BYPASS_LIMIT
        if due:
            self._queue = sorted(((self._key(seq), seq) for _, seq in self._queue), key=lambda entry: entry[0])

    def remove(self, seq: Sequence) -> None:
        self._queue = [entry for entry in self._queue if entry[1] is not seq]
        self._passed.pop(id(seq), None)

    def __contains__(self, seq: object) -> bool:
        return any(entry[1] is seq for entry in self._queue)

    def __iter__(self) -> Iterator[Sequence]:
        return iter([seq for _, seq in self._queue])

    def __len__(self) -> int:
        return len(self._queue)


class PriorityQueue(FcfsQueue):
    name = "priority"

    def band(self, seq: Sequence) -> Rank:
        return (seq.group.request.priority,)

    def outranks(self, waiting: Sequence, victim: Sequence, running: list[Sequence]) -> bool:
        return waiting.group.request.priority < victim.group.request.priority
