"""The scheduler's invariants, checked after every step in the tests and, under the profile's
`debug_scheduler_invariants`, when served: a request that is neither waiting nor running would never end (its
client waits until a timeout) and would keep its KV blocks; a block held by no running sequence, or a reference
count that disagrees with the references, shrinks the pool for good. Either is caught the step it happens.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from engine.core.kv_manager import BLOCK_TOKENS, require

if TYPE_CHECKING:
    from engine.core.scheduler import Scheduler


def check_invariants(sched: Scheduler) -> None:
    """The invariants (InvariantBroken when one breaks): every live request's unfinished candidates are each in
    exactly one place, waiting (holding nothing) or running; a running one holds room for what it computed;
    and the pool's accounting (engine.core.kv_manager `check`) holds with the running ones as its holders."""
    running, waiting = {id(s) for s in sched.running}, {id(s) for s in sched.waiting}
    require(len(running) == len(sched.running) and len(waiting) == len(sched.waiting), "a sequence is queued twice")
    require(not running & waiting, "a sequence is both waiting and running")
    for seq in sched.waiting:
        require(not seq.blocks and not seq.reserved and seq.num_computed == 0, "a waiting sequence holds KV")
    for seq in sched.running:
        require(not seq.finished and id(seq.group) in sched.requests, "a running sequence has ended")
        require(len(seq.blocks) * BLOCK_TOKENS >= seq.num_computed, "a sequence computed past its blocks")
    for group in sched.requests.values():
        live = [seq for seq in group.sequences if not seq.finished]
        require(bool(live), f"request {group.request.request_id} has ended without its final output")
        for seq in live:
            require((id(seq) in running) != (id(seq) in waiting),
                    f"request {group.request.request_id} is neither waiting nor running")
    sched.kv.check(sched.running)
