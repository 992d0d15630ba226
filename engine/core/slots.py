"""The KV slot table: which sequence holds which KV cache row, and how many KV blocks running sequences use.

Invariant: decoding sequences occupy slots 0..B-1 in `decoding` order, and whatever is being prefilled (a new
request's first candidate, or a preempted candidate being recomputed) holds slot B. A retiring sequence's slot is
filled by the last row (and the prefilling one moves down after it), so the decode step always reads plain views
of the cache: rows 0..B-1.

KV memory is counted in blocks of `BLOCK_TOKENS` positions, as they are used: a decoding sequence holds the blocks
of the positions it has written plus the one its next token writes, and a request being prefilled claims its
prompt's blocks for each of its candidates. Nothing is reserved for tokens not yet generated; when a step's rows
would pass the budget, the scheduler preempts the newest (engine.core.scheduler). On the host the cache's pages
are committed only where positions are written (engine.model.kv_cache), so resident KV memory follows the same
count.
"""

from __future__ import annotations

from engine.core.sequence import Sequence, SequenceGroup
from engine.model.kv_cache import KVCache

BLOCK_TOKENS = 16  # a 4 KiB page of one head's fp32 K (head_dim 64) holds 16 positions


def blocks(positions: int) -> int:
    return -(-positions // BLOCK_TOKENS)


class Recompute:
    """A preempted candidate on its way back: its prompt and every token it has streamed but the last (which the
    next decode step feeds, as for any running row) prefilled again into a slot. Nothing is sampled from it, so
    the client sees the same tokens, later."""

    def __init__(self, seq: Sequence) -> None:
        self.seq = seq
        self.group = seq.group
        self.sequences = [seq]  # the row that holds slot B while prefilling (SlotTable.retire moves it down)
        self.tokens = seq.prompt_ids + seq.output_ids[:-1]
        self.prefilled = 0  # positions of `tokens` in the cache


Prefilling = SequenceGroup | Recompute


def owner(job: Prefilling) -> SequenceGroup:
    return job.group if isinstance(job, Recompute) else job


class SlotTable:
    def __init__(self, cache: KVCache, kv_budget_tokens: int | None = None) -> None:
        self.cache = cache
        self.max_slots = cache.slots
        self.max_len = cache.max_len
        self.kv_budget = kv_budget_tokens or self.max_slots * self.max_len
        cache.resident_budget = self.kv_budget  # freed slots keep their pages, zeroed, up to what admission allows
        self.decoding: list[Sequence] = []
        self.prefilling: Prefilling | None = None

    # -- KV blocks -----------------------------------------------------------------------------

    @property
    def budget_blocks(self) -> int:
        return self.kv_budget // BLOCK_TOKENS

    @staticmethod
    def claim(group: SequenceGroup) -> int:
        """Blocks a new request needs to be prefilled and placed: its prompt and first token, per candidate."""
        return group.params.width * blocks(len(group.request.prompt_ids) + 1)

    def used_blocks(self) -> int:
        """Blocks held now, each decoding row's next position included, plus what the prefill in progress claims."""
        used = sum(blocks(seq.kv_len + 1) for seq in self.decoding)
        job = self.prefilling
        if isinstance(job, Recompute):
            used += blocks(len(job.tokens) + 1)
        elif job is not None:
            used += self.claim(job)
        return used

    def fits(self, need: int, width: int, slots_in_use: int, used: int) -> bool:
        """Room for `width` more rows needing `need` blocks, keeping one block of growth for every row (so a
        request just admitted is not preempted by the next decode step)."""
        rows = slots_in_use + width
        return rows <= self.max_slots and used + need + rows <= self.budget_blocks

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

    def resume(self, job: Recompute) -> None:
        """A recomputed candidate is a decode row again (it already sits at slot B)."""
        if self.prefilling is job:
            self.prefilling = None
        job.seq.slot = len(self.decoding)
        self.decoding.append(job.seq)

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
            row = self.prefilling.sequences[0]
            cache.copy_slot(row.slot, len(self.decoding), row.kv_len)
            cache.release(len(self.decoding), row.kv_len)
            vacated, row.slot = row.slot, len(self.decoding)
        cache.release(vacated)
        return True

    def drop_prefill(self, group: SequenceGroup) -> Prefilling | None:
        """The prefilling request is gone or preempted: give back its partial prompt's memory. Returns the job
        dropped, if it was this group's."""
        job = self.prefilling
        if job is None or owner(job) is not group:
            return None
        self.prefilling = None
        if job.sequences and job.sequences[0].slot >= 0:
            self.cache.release(job.sequences[0].slot)
        return job

    def busy(self) -> bool:
        return bool(self.prefilling or self.decoding)

    def release_all(self) -> None:
        """Idle: whatever a failed prefill or fork left, give it back."""
        self.cache.release_all()
