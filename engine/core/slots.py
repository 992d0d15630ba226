"""The KV slot table: which sequence holds which KV cache row, and the KV reservations of running requests.

Invariant: decoding sequences occupy slots 0..B-1 in `decoding` order, and a request in prefill holds slot B
(its first candidate). A retiring sequence's slot is filled by the last row (and the prefilling parent moves
down after it), so the decode step always reads plain views of the cache: rows 0..B-1.

Admission control on KV memory: a running request reserves width x (prompt + max_tokens) positions, so
admitted requests can always run to their end. This is the project's counterpart of nano-vllm's BlockManager.
"""

from __future__ import annotations

from engine.core.sequence import Sequence, SequenceGroup
from engine.model.kv_cache import KVCache


class SlotTable:
    def __init__(self, cache: KVCache, kv_budget_tokens: int | None = None) -> None:
        self.cache = cache
        self.max_slots = cache.slots
        self.max_len = cache.max_len
        self.kv_budget = kv_budget_tokens or self.max_slots * self.max_len
        cache.resident_budget = self.kv_budget  # freed slots keep their pages, zeroed, up to what admission allows
        self.reserved = 0
        self.decoding: list[Sequence] = []
        self.prefilling: SequenceGroup | None = None

    # -- reservations --------------------------------------------------------------------------

    def fits(self, group: SequenceGroup, slots_in_use: int, reserved: int) -> bool:
        return slots_in_use + group.params.width <= self.max_slots and reserved + group.kv_need <= self.kv_budget

    def reserve(self, group: SequenceGroup) -> None:
        self.reserved += group.kv_need
        group.admitted = True

    def release(self, group: SequenceGroup) -> None:
        if group.admitted:
            group.admitted = False
            self.reserved -= group.kv_need

    # -- rows ----------------------------------------------------------------------------------

    def place(self, group: SequenceGroup, children: list[Sequence]) -> list[Sequence]:
        """Put a prefilled parent's n/best_of children in the slots right after it (copying its K/V), and
        append every candidate to the decode rows."""
        parent = group.sequences[0]
        for child in children:
            child.slot = parent.slot + child.index
            self.cache.copy_slot(parent.slot, child.slot, parent.kv_len)
            group.sequences.append(child)
        self.decoding.extend(group.sequences)
        return list(group.sequences)

    def retire(self, seq: Sequence) -> bool:
        """Free the sequence's slot, moving the last row (and any prefill in progress) down. False when the
        sequence holds no decode row (already retired)."""
        if seq not in self.decoding:
            return False
        cache = self.cache
        index = self.decoding.index(seq)
        last = len(self.decoding) - 1
        if index != last:
            moved = self.decoding[last]
            cache.copy_slot(last, index, moved.kv_len)
            cache.release(index, moved.kv_len)  # the retired sequence may have reached further
            moved.slot = index
            self.decoding[index] = moved
        self.decoding.pop()
        vacated = last
        if self.prefilling is not None and self.prefilling.prefilled > 0:
            parent = self.prefilling.sequences[0]
            cache.copy_slot(parent.slot, len(self.decoding), parent.kv_len)
            cache.release(len(self.decoding), parent.kv_len)
            vacated, parent.slot = parent.slot, len(self.decoding)
        cache.release(vacated)
        return True

    def drop_prefill(self, group: SequenceGroup) -> None:
        """The prefilling request is gone: give back its partial prompt's memory."""
        if self.prefilling is group:
            self.prefilling = None
            if group.sequences and group.sequences[0].slot >= 0:
                self.cache.release(group.sequences[0].slot)

    def busy(self) -> bool:
        return bool(self.prefilling or self.decoding)

    def release_all(self) -> None:
        """Idle: whatever a failed prefill or fork left, give it back."""
        self.cache.release_all()
