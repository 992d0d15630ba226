"""The scheduler's invariants, checked after every step in the tests and, under the profile's
`debug_scheduler_invariants`, when served: a request that is neither waiting nor running would never end (its
client waits until a timeout) and would keep its KV blocks; a block held by no running sequence, or a reference
count that disagrees with the references, shrinks the pool for good. Either is caught the step it happens.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping

from engine.core.kv_manager import BLOCK_TOKENS, KVManager, require
from engine.core.sequence import Sequence, SequenceGroup


def check_invariants(running: list[Sequence], waiting: Collection[Sequence],
                     requests: Mapping[int, SequenceGroup], kv: KVManager) -> None:
    """The invariants (InvariantBroken when one breaks): every live request's unfinished candidates are each in
    exactly one place, waiting (holding nothing) or running; a running one holds room for what it computed;
    and the pool's accounting (engine.core.kv_manager `check`) holds with the running ones as its holders."""
    running_ids, waiting_ids = {id(s) for s in running}, {id(s) for s in waiting}
    require(len(running_ids) == len(running) and len(waiting_ids) == len(waiting), "a sequence is queued twice")
    require(not running_ids & waiting_ids, "a sequence is both waiting and running")
    for seq in waiting:
        require(not seq.blocks and not seq.reserved and seq.num_computed == 0, "a waiting sequence holds KV")
    for seq in running:
        require(not seq.finished and id(seq.group) in requests, "a running sequence has ended")
        require(len(seq.blocks) * BLOCK_TOKENS >= seq.num_computed, "a sequence computed past its blocks")
    for group in requests.values():
        live = [seq for seq in group.sequences if not seq.finished]
        require(bool(live), f"request {group.request.request_id} has ended without its final output")
        for seq in live:
            require((id(seq) in running_ids) != (id(seq) in waiting_ids),
                    f"request {group.request.request_id} is neither waiting nor running")
    kv.check(running)
