"""Fair sharing between tenants: the Virtual Token Counter (Sheng et al., "Fairness in Serving Large Language
Models", OSDI 2024).

Each tenant's service is counted in weighted tokens, `W_PROMPT` per prompt token computed and `W_OUTPUT` per token
generated, divided by the tenant's weight (from the keys file, default 1). The waiting request of the tenant with the
least service goes next; within a tenant, in the priority policy's order (engine.core.waiting_queue). A tenant that
becomes active again is lifted to the least counter of the active tenants, so idling earns it no burst of credit.
Counters live only while a tenant has requests in flight, so memory stays bounded by the tenants in flight.

VTC orders admission only; here a waiting request may also take the place of a running one when the batch or the
blocks are full, so that one tenant's flood cannot hold every batch row while another waits: when the running
one's tenant has received more service and holds more than its weighted share of rows, at least one more than the
waiting one's would then hold (so two tenants in balance never preempt each other in turn). The preempted request
goes back to its own tenant's queue and resumes where it was (engine.core.scheduler).
"""

from __future__ import annotations

import collections
from collections.abc import Iterator

from engine.core.sequence import Sequence, SequenceGroup
from engine.core.waiting_queue import PriorityQueue, Rank, arrival

W_PROMPT = 1.0
W_OUTPUT = 2.0  # VTC's weights: an output token costs about twice an input token


def tenant_of(seq: Sequence) -> str:
    return seq.group.request.tenant or ""


class FairQueue:
    name = "fair"

    def __init__(self) -> None:
        self._waiting: dict[str, PriorityQueue] = {}  # per tenant
        self.counters: dict[str, float] = {}
        self._in_flight: collections.Counter[str] = collections.Counter()

    # -- order -----------------------------------------------------------------------------------

    def rank(self, seq: Sequence) -> Rank:
        """Running order, for the blocks: (priority, arrival), the order of a tenant's own queue. It never moves
        with service (engine.core.waiting_queue FcfsQueue.rank says why)."""
        return (seq.group.request.priority, *arrival(seq))

    def victim(self, running: list[Sequence]) -> Sequence | None:
        """The newest running sequence of the tenant that has received the most service."""
        if not running:
            return None
        most = max({tenant_of(seq) for seq in running}, key=lambda t: self.counters.get(t, 0.0))
        return [seq for seq in running if tenant_of(seq) == most][-1]

    def outranks(self, waiting: Sequence, victim: Sequence, running: list[Sequence]) -> bool:
        tenant, other = tenant_of(waiting), tenant_of(victim)
        if tenant == other:
            return waiting.group.request.priority < victim.group.request.priority
        if self.counters.get(tenant, 0.0) >= self.counters.get(other, 0.0):
            return False
        rows = collections.Counter(tenant_of(seq) for seq in running)
        weight = max(waiting.group.request.tenant_weight, 1e-6)
        other_weight = max(victim.group.request.tenant_weight, 1e-6)
        return (rows[other] - 1) / other_weight >= (rows[tenant] + 1) / weight

    def _next_tenant(self) -> str | None:
        return min(self._waiting, key=lambda t: (self.counters.get(t, 0.0), self._waiting[t].head_key()), default=None)

    # -- service -----------------------------------------------------------------------------------

    def charge(self, seq: Sequence, prompt_tokens: int, output_tokens: int) -> None:
        tenant = tenant_of(seq)
        weight = max(seq.group.request.tenant_weight, 1e-6)
        self.counters[tenant] = self.counters.get(tenant, 0.0) + \
            (W_PROMPT * prompt_tokens + W_OUTPUT * output_tokens) / weight

    def done(self, group: SequenceGroup) -> None:
        tenant = group.request.tenant or ""
        self._in_flight[tenant] -= 1
        if self._in_flight[tenant] <= 0:
            del self._in_flight[tenant]
            self.counters.pop(tenant, None)

    # -- the queue ---------------------------------------------------------------------------------

    def add(self, seq: Sequence) -> None:
        """A new request: a tenant active again is lifted to the least counter of the active ones."""
        tenant = tenant_of(seq)
        if not self._in_flight[tenant]:
            active = [self.counters.get(t, 0.0) for t in self._in_flight if self._in_flight[t] > 0]
            self.counters[tenant] = max(self.counters.get(tenant, 0.0), min(active, default=0.0))
        self._in_flight[tenant] += 1
        self.add_preempted(seq)

    def add_preempted(self, seq: Sequence) -> None:
        self._waiting.setdefault(tenant_of(seq), PriorityQueue()).add(seq)

    def peek(self) -> Sequence | None:
        tenant = self._next_tenant()
        return None if tenant is None else self._waiting[tenant].peek()

    def pop(self) -> Sequence:
        tenant = self._next_tenant()
        assert tenant is not None, "pop from an empty queue"
        seq = self._waiting[tenant].pop()
        self._forget_if_empty(tenant)
        return seq

    def remove(self, seq: Sequence) -> None:
        tenant = tenant_of(seq)
        if tenant in self._waiting:
            self._waiting[tenant].remove(seq)
            self._forget_if_empty(tenant)

    def _forget_if_empty(self, tenant: str) -> None:
        if not self._waiting[tenant]:
            del self._waiting[tenant]

    def __contains__(self, seq: object) -> bool:
        return any(seq in queue for queue in self._waiting.values())

    def __iter__(self) -> Iterator[Sequence]:
        return iter([seq for queue in list(self._waiting.values()) for seq in queue])

    def __len__(self) -> int:
        return sum(map(len, self._waiting.values()))
