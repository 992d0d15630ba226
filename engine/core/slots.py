"""The slot table: which sequence runs in which batch row, and the KV blocks each one holds.

Invariant: decoding sequences occupy slots 0..B-1 in `decoding` order, and whatever is being prefilled (a new
request's first candidate, or a preempted candidate being recomputed) holds slot B. A retiring sequence's slot is
taken by the last row (and the prefilling one moves down after it), so a decode step reads rows 0..B-1. Within a
step, the prompts the step's plan completes sit in the rows after B, each with its candidates' rows after it, and
the prompt left half-prefilled after them (engine.core.planner); once they are placed the invariant holds again.
Moving a sequence moves its block table (one row of the cache's tables), never its K/V.

KV memory is the pool's blocks (engine.core.block_pool), taken as positions are about to be written: a prefill
chunk takes the blocks its tokens fill, and a decode step takes a block for each row whose next position starts
one. Nothing is reserved for tokens not yet generated. An n/best_of fork holds its parent's full blocks again
and copies only a partly filled last one; a prefix-cache hit holds the cached blocks. When a step's rows would need
more blocks than are left, the scheduler preempts the newest (engine.core.scheduler).
"""

from __future__ import annotations

from engine.core.block_pool import BlockPool
from engine.core.sequence import Sequence, SequenceGroup
from engine.model.kv_cache import NULL_BLOCK, KVCache

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


def job_tokens(job: Prefilling) -> list[int]:
    """The tokens a prefill job writes: a new request's prompt, or a recomputed candidate's."""
    return job.tokens if isinstance(job, Recompute) else job.request.prompt_ids


def job_rows(job: Prefilling) -> int:
    """The decode rows a prefill job becomes: a new request's n/best_of candidates, or the one recomputed."""
    return 1 if isinstance(job, Recompute) else job.params.width


def still_takes(job: Prefilling) -> int:
    """Blocks a prefill job will still take: the rest of its tokens and the position its first decode step writes,
    and a copy of the partly filled last block for each of its n/best_of children."""
    total = blocks(len(job_tokens(job)) + 1) + job_rows(job) - 1
    held = len(job.sequences[0].blocks) if job.sequences else 0
    return max(0, total - held)


class SlotTable:
    def __init__(self, cache: KVCache, kv_budget_tokens: int | None = None) -> None:
        if cache.block_size != BLOCK_TOKENS:
            raise ValueError(f"the KV cache's blocks hold {cache.block_size} positions; the scheduler's {BLOCK_TOKENS}")
        self.cache = cache
        self.max_slots = cache.slots
        self.max_len = cache.max_len
        self.kv_budget = kv_budget_tokens or self.max_slots * self.max_len
        cache.clear_tables()
        self.pool = BlockPool(min(cache.num_blocks - 1, self.kv_budget // BLOCK_TOKENS))
        self.decoding: list[Sequence] = []
        self.prefilling: Prefilling | None = None

    # -- KV blocks -----------------------------------------------------------------------------

    @property
    def budget_blocks(self) -> int:
        return self.pool.total

    def used_blocks(self) -> int:
        """Blocks the running sequences hold (shared ones once)."""
        return self.pool.used

    def pending(self) -> int:
        """Blocks the prefill in progress will still take (`still_takes`)."""
        return 0 if self.prefilling is None else still_takes(self.prefilling)

    def available(self) -> int:
        """Blocks free for new work: what the pool has left (free and idle cached blocks), less what the prefill
        in progress will still take."""
        return self.pool.available - self.pending()

    def decode_need(self) -> int:
        """Blocks the next decode step takes: one for each row whose next position starts a block."""
        return sum(1 for seq in self.decoding if len(seq.blocks) * BLOCK_TOKENS <= seq.kv_len)

    def fits(self, need: int, width: int, slots_in_use: int, available: int) -> bool:
        """Room for `width` more rows needing `need` blocks (through the position of their first decoded token)
        and for the blocks the running rows take at the next decode step, so a request just admitted is not
        preempted by that step. Nothing more is held back for growth: a row that later finds no block preempts
        the newest, whose blocks stay cached for its return (engine.core.preemption)."""
        return slots_in_use + width <= self.max_slots and need + self.decode_need() <= available

    def grow(self, seq: Sequence, end: int) -> None:
        """Blocks for `seq`'s positions up to `end` (about to be written), entered in its slot's table."""
        table = self.cache.rows[seq.slot]
        while len(seq.blocks) * BLOCK_TOKENS < end:
            block = self.pool.take()
            table[len(seq.blocks)] = block
            seq.blocks.append(block)

    def grow_decoding(self) -> None:
        """Each decode row's next position has its block (the step's `decode_need`, which the scheduler made room
        for)."""
        for seq in self.decoding:
            self.grow(seq, seq.kv_len + 1)

    def share(self, seq: Sequence, held: list[int]) -> None:
        """`seq` starts with these blocks (a cached prefix), holding each once more."""
        for block in held:
            self.pool.hold(block)
        seq.blocks = list(held)
        self._write_table(seq)

    def free(self, seq: Sequence) -> None:
        """Give back every block `seq` holds, its last first: of the cached ones among them, the tail of a chain
        becomes the least recently used and is evicted before its root (as vLLM frees them), so what stays cached
        is a prefix other prompts can still start with."""
        for block in reversed(seq.blocks):
            self.pool.release(block)
        seq.blocks = []

    # -- rows ----------------------------------------------------------------------------------

    def seat(self, seq: Sequence, slot: int) -> None:
        """`seq` runs in row `slot`: its block table goes there."""
        seq.slot = slot
        self._write_table(seq)

    def _write_table(self, seq: Sequence) -> None:
        row = self.cache.rows[seq.slot]
        row[: len(seq.blocks)] = seq.blocks
        row[len(seq.blocks):] = NULL_BLOCK

    def place(self, group: SequenceGroup, children: list[Sequence]) -> list[Sequence]:
        """Put a prefilled parent's n/best_of children in the slots right after it, sharing its full blocks (a
        partly filled last block is copied: each child writes its own next positions there), and append every
        candidate to the decode rows."""
        parent = group.sequences[0]
        full = parent.kv_len // BLOCK_TOKENS
        for child in children:
            child.blocks = parent.blocks[:full]
            for block in child.blocks:
                self.pool.hold(block)
            if parent.kv_len % BLOCK_TOKENS:
                copy = self.pool.take()
                self.cache.copy_block(parent.blocks[full], copy)
                child.blocks.append(copy)
            self.seat(child, parent.slot + child.index)
            group.sequences.append(child)
        self.decoding.extend(group.sequences)
        return list(group.sequences)

    def resume(self, job: Recompute) -> None:
        """A recomputed candidate is a decode row again, seated after the others."""
        if self.prefilling is job:
            self.prefilling = None
        self.seat(job.seq, len(self.decoding))
        self.decoding.append(job.seq)

    def retire(self, seq: Sequence) -> bool:
        """Give back the sequence's blocks and its row, moving the last row (and any prefill in progress) down.
        False when the sequence holds no decode row (already retired)."""
        if seq not in self.decoding:
            return False
        index = self.decoding.index(seq)
        self.free(seq)
        moved = self.decoding.pop()
        if moved is not seq:
            self.decoding[index] = moved
            self.seat(moved, index)
        if self.prefilling is not None and self.prefilling.sequences:
            self.seat(self.prefilling.sequences[0], len(self.decoding))
        return True

    def drop_prefill(self, group: SequenceGroup) -> Prefilling | None:
        """The prefilling request is gone or preempted: give back its partial prompt's blocks. Returns the job
        dropped, if it was this group's."""
        job = self.prefilling
        if job is None or owner(job) is not group:
            return None
        self.prefilling = None
        for seq in job.sequences:
            self.free(seq)
        return job

    def busy(self) -> bool:
        return bool(self.prefilling or self.decoding)
