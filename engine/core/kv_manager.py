"""The KV manager: which pool blocks each sequence holds, the prefix cache's blocks, and the batch rows' tables.

One call gives a sequence room for its next positions, or changes nothing: `allocate(seq, end, hits)` first holds
the prompt's prefix-cache hits (so that taking new blocks can never evict them), then takes the new blocks, all or
nothing, as vLLM v1's `KVCacheManager.allocate_slots` does. `free(seq)` gives every block back (finished,
cancelled or preempted); the full blocks a sequence wrote stay keyed in the prefix cache, idle, until the pool
needs the room.

The pool's blocks (engine.core.block_pool) are free, idle (cached, held by nobody) or held. A prefix-cache hit and
an n/best_of fork share a block by holding it again; a fork copies only a partly filled last block, into a block
its parent reserved when its prompt's last span was allocated (so a fork never fails for want of a block).

A batch row's block table (one row of the cache's tables) is written when a sequence is seated there
(`seat`): moving a sequence to another row moves its table, never its K/V.
"""

from __future__ import annotations

from collections.abc import Iterable
from collections.abc import Sequence as Seq

from engine.core.block_pool import BlockPool
from engine.core.prefix_cache import BlockKey, PrefixCache, salt_of
from engine.core.sequence import Sequence
from engine.model.kv_cache import NULL_BLOCK, KVCache

BLOCK_TOKENS = 16  # a 4 KiB page of one head's fp32 K (head_dim 64) holds 16 positions
WATERMARK = 0.01  # of the pool, kept free at admission (as vLLM keeps 1 %) while requests run


def blocks(positions: int) -> int:
    return -(-positions // BLOCK_TOKENS)


class InvariantBroken(AssertionError):
    """A scheduler or pool invariant does not hold (raised whatever Python's -O, unlike an assert)."""


def require(condition: bool, what: str) -> None:
    if not condition:
        raise InvariantBroken(what)


class KVManager:
    def __init__(self, cache: KVCache, budget_tokens: int | None = None, prefix_cache_tokens: int = 0) -> None:
        if cache.block_size != BLOCK_TOKENS:
            raise ValueError(f"the KV cache's blocks hold {cache.block_size} positions; the scheduler's {BLOCK_TOKENS}")
        self.cache = cache
        self.budget_tokens = budget_tokens or cache.slots * cache.max_len
        cache.clear_tables()
        self.pool = BlockPool(min(cache.num_blocks - 1, self.budget_tokens // BLOCK_TOKENS))
        self.watermark = max(1, int(self.pool.total * WATERMARK))
        # K/V of past prompts and outputs, reused by requests that start the same way (0 tokens: off)
        self.prefix_cache = PrefixCache(self.pool, prefix_cache_tokens, BLOCK_TOKENS) \
            if prefix_cache_tokens > 0 else None
        self.row_owner: list[Sequence | None] = [None] * cache.slots  # whose table each batch row holds

    @property
    def total_blocks(self) -> int:
        return self.pool.total

    # -- allocation ----------------------------------------------------------------------------

    def cached_prefix(self, seq: Sequence) -> list[int]:
        """The pool blocks that the prefix cache holds of the sequence's tokens (a peek: nothing held or moved),
        leaving at least its last token to compute (its logits are sampled)."""
        if self.prefix_cache is None:
            return []
        return self.prefix_cache.lookup(self._chain(seq))

    def _chain(self, seq: Sequence) -> list[tuple[BlockKey, BlockKey | None, tuple[int, ...]]]:
        """The prefix cache's keys of the sequence's tokens, made once for its current length (a waiting request
        is looked up every step it waits)."""
        length = seq.num_tokens
        if seq.chain is None or seq.chain[0] != length:
            assert self.prefix_cache is not None
            chain = self.prefix_cache.prompt_chain(seq.tokens(0, length), salt_of(seq.group))
            seq.chain = (length, chain)
        return seq.chain[1]

    def fits(self, seq: Sequence, end: int, hits: Seq[int] = (), reserve: int = 0, headroom: int = 0) -> bool:
        """Whether `allocate` with these arguments would succeed now."""
        new = max(0, blocks(end) - len(seq.blocks) - len(hits))
        idle_hits = sum(1 for block in hits if self.pool.refs[block] == 0)  # holding one takes it from the idle
        return new + reserve + idle_hits + headroom <= self.pool.available

    def allocate(self, seq: Sequence, end: int, hits: Seq[int] = (), reserve: int = 0, headroom: int = 0) -> bool:
        """Room for the sequence's positions up to `end`, or False having changed nothing. `hits`: cached blocks
        it starts with (a sequence holding none yet), held first; `reserve`: blocks set aside for its n/best_of
        forks' copies; `headroom`: blocks that must stay available after (admission's watermark)."""
        if not self.fits(seq, end, hits, reserve, headroom):
            return False
        new = max(0, blocks(end) - len(seq.blocks) - len(hits))
        for block in hits:
            self.pool.hold(block)
        seq.blocks.extend(hits)
        seq.blocks.extend(self.pool.take() for _ in range(new))
        seq.reserved.extend(self.pool.take() for _ in range(reserve))
        return True

    def free(self, seq: Sequence) -> None:
        """Give back every block `seq` holds, its last first: of the cached ones among them, the tail of a chain
        becomes the least recently used and is evicted before its root (as vLLM frees them), so what stays cached
        is a prefix other prompts can still start with."""
        for block in reversed(seq.blocks + seq.reserved):
            self.pool.release(block)
        seq.blocks, seq.reserved = [], []
        if 0 <= seq.slot < len(self.row_owner) and self.row_owner[seq.slot] is seq:
            self.row_owner[seq.slot] = None
        seq.slot = -1

    def fork(self, parent: Sequence, child: Sequence) -> None:
        """`child` continues its parent's prompt: it holds the parent's full blocks again, and a partly filled
        last block is copied into one the parent reserved (each child writes its own next positions there)."""
        full = parent.num_computed // BLOCK_TOKENS
        child.blocks = parent.blocks[:full]
        for block in child.blocks:
            self.pool.hold(block)
        if parent.num_computed % BLOCK_TOKENS:
            copy = parent.reserved.pop()
            self.cache.copy_block(parent.blocks[full], copy)
            child.blocks.append(copy)

    # -- the prefix cache ----------------------------------------------------------------------

    def keep(self, seq: Sequence, length: int) -> None:
        """Key the full blocks among the sequence's first `length` positions (their K/V written) in the prefix
        cache: a prompt once its first token is out, a finished answer, a preempted candidate's K/V."""
        if self.prefix_cache is not None and seq.blocks:
            self.prefix_cache.store(seq.tokens(0, length), salt_of(seq.group), seq.blocks, length)

    # -- batch rows ----------------------------------------------------------------------------

    def seat(self, seq: Sequence, row: int) -> None:
        """`seq` runs in batch row `row` this step: its block table goes there (only the new entries, when the row
        already holds it)."""
        table = self.cache.rows[row]
        if self.row_owner[row] is seq and seq.slot == row:
            table[seq.table_len:len(seq.blocks)] = seq.blocks[seq.table_len:]
        else:
            table[:len(seq.blocks)] = seq.blocks
            table[len(seq.blocks):] = NULL_BLOCK
            self.row_owner[row] = seq
        seq.slot, seq.table_len = row, len(seq.blocks)

    # -- invariants ----------------------------------------------------------------------------

    def check(self, holders: Iterable[Sequence]) -> None:
        """The pool's accounting (raises InvariantBroken): every held block is held by the sequences given (the
        running ones), as many times as its reference count says; free + idle + held is the pool; an idle block
        is cached, a free one is not."""
        pool = self.pool
        counted = [0] * (pool.total + 1)
        for seq in holders:
            for block in seq.blocks + seq.reserved:
                counted[block] += 1
        counted[0] = 1  # the null block
        require(counted == pool.refs, "a block's reference count is not the number of running sequences holding it")
        held = sum(1 for refs in pool.refs[1:] if refs)
        require(len(pool.free) + len(pool.idle) + held == pool.total, "free + idle + held is not the pool")
        require(all(pool.cached[block] and not pool.refs[block] for block in pool.idle), "an idle block is in use")
        require(not any(pool.cached[block] or pool.refs[block] for block in pool.free), "a free block is in use")
        if self.prefix_cache is not None:
            require(all(pool.cached[block] for block in self.prefix_cache.key_of), "a keyed block is not cached")
