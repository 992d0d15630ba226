"""Automatic prefix caching: the K/V of past prompts (and finished outputs), kept in token blocks.

A prompt is cut into blocks of `block_tokens`; block i is keyed by the chain (key of block i-1, its own
tokens), rooted in a salt that carries everything else the K/V depends on (the LoRA adapter, a digest of
the image inputs). A new request copies the K/V of its longest cached chain into its KV slot and prefills
only the rest. Entries store their tokens and parent key, so a hash collision can never share K/V
between different token sequences. Blocks live in one preallocated pool; the least recently used are
reused when it is full. Everything is plain tensor copies on the cache's device, so the GPU engine uses
the same logic.

The pool lives inside the engine's KV memory and yields to the running requests (docs/kv-memory.md): each step the
scheduler says how many blocks the running rows leave (`shrink`), and the least recently used blocks past that go,
their pages given back on the host. So the prefix cache holds only memory no running request needs, as a paged
cache's freed blocks do, and running requests may use the whole budget.

A key is a 64-bit keyed BLAKE2b of the parent's key and the block's tokens, keyed by the salt: stable across
processes, so the keys this cache reports in its KV events (engine.core.kv_events, when `events` is a list) mean the
same thing to a router after a restart. The salt is (LoRA adapter, then whatever else the K/V depends on).
"""

from __future__ import annotations

import collections
import hashlib
from array import array
from dataclasses import dataclass
from typing import Any

from engine.core import kv_events
from engine.model.kv_cache import KVCache, give_back, zeroed

BlockKey = int


@dataclass
class _Block:
    index: int  # row in the pool
    parent: BlockKey | None
    tokens: tuple[int, ...]


class PrefixCache:
    def __init__(self, cache: KVCache, capacity_tokens: int, block_tokens: int = 16) -> None:
        layers, _, heads, _, dim = cache.k.shape
        self.cache = cache
        self.block_tokens = block_tokens
        self.capacity = max(capacity_tokens // block_tokens, 0)
        shape = (layers, self.capacity, heads, block_tokens, dim)
        # on the host, pages are committed as rows are first written (a store runs after the prompt's first token is
        # out, never on the way to it) and given back when the running requests need the memory (`shrink`)
        self.k = zeroed(shape, cache.k.dtype, cache.k.device)
        self.v = zeroed(shape, cache.v.dtype, cache.v.device)
        self.blocks: collections.OrderedDict[BlockKey, _Block] = collections.OrderedDict()  # LRU first
        self.free = list(range(self.capacity - 1, -1, -1))
        self.allowance = self.capacity  # blocks it may hold now: what the running requests leave of the KV memory
        self.hit_tokens = 0  # counters for metrics and benchmarks
        self.queried_tokens = 0
        self.events: list[dict[str, Any]] | None = None  # a list: stored and evicted blocks are recorded there

    def __bool__(self) -> bool:
        return self.capacity > 0

    def _chain(self, tokens: list[int], salt: object, limit: int):
        """(key, parent key, block tokens) of each full block within the first `limit` tokens."""
        parent: BlockKey | None = None
        root = hashlib.blake2b(repr(("sie-prefix", salt)).encode(), digest_size=32).digest()
        for start in range(0, limit - self.block_tokens + 1, self.block_tokens):
            block = tuple(tokens[start : start + self.block_tokens])
            data = (parent or 0).to_bytes(8, "big") + array("q", block).tobytes()
            key = int.from_bytes(hashlib.blake2b(data, digest_size=8, key=root).digest(), "big")
            yield key, parent, block
            parent = key

    def lookup(self, tokens: list[int], salt: object, touch: bool = True) -> list[int]:
        """Pool rows of the longest cached chain of full blocks, leaving at least one token to prefill
        (its logits start the generation). `touch=False` only peeks (no LRU update, no counting)."""
        rows: list[int] = []
        for key, parent, block in self._chain(tokens, salt, len(tokens) - 1):
            entry = self.blocks.get(key)
            if entry is None or entry.parent != parent or entry.tokens != block:
                break
            if touch:
                self.blocks.move_to_end(key)
            rows.append(entry.index)
        if touch:
            self.queried_tokens += len(tokens)
            self.hit_tokens += len(rows) * self.block_tokens
        return rows

    def load(self, rows: list[int], slot: int) -> int:
        """Copy the blocks into positions 0.. of `slot`; returns the number of positions filled."""
        self._copy(list(enumerate(rows)), slot, into_cache=True)
        return len(rows) * self.block_tokens

    def store(self, tokens: list[int], salt: object, slot: int, length: int) -> None:
        """Keep the full blocks of the first `length` positions of `slot` (K/V already computed)."""
        new: list[tuple[int, int]] = []  # (block number in the slot, pool row)
        stored: list[tuple[int, BlockKey, BlockKey | None, tuple[int, ...]]] = []  # for the KV events
        chain: set[BlockKey] = set()
        for number, (key, parent, block) in enumerate(self._chain(tokens, salt, length)):
            chain.add(key)
            entry = self.blocks.pop(key, None)
            if entry is not None and entry.parent == parent and entry.tokens == block:
                self.blocks[key] = entry  # already cached: now the most recently used
                continue
            # a key collision (same hash, other tokens) takes over the colliding entry's row
            row = entry.index if entry is not None else self._take_row(chain)
            if row is None:
                break
            self.blocks[key] = _Block(row, parent, block)
            new.append((number, row))
            stored.append((number, key, parent, block))
        self._copy(new, slot, into_cache=False)
        if self.events is not None and stored:
            self.events.append(self._stored_event(stored, salt))

    def _stored_event(self, stored: list[tuple[int, BlockKey, BlockKey | None, tuple[int, ...]]], salt: object
                      ) -> dict[str, Any]:
        """vLLM's BlockStored for the blocks this store added: the LoRA name on every block's extra keys, the
        rest of the salt (image digest, tenant) on the chain's first block, as vLLM places its cache salt."""
        parts = salt if isinstance(salt, tuple) else (salt,)
        adapter, rest = parts[0], tuple(p for p in parts[1:] if p is not None)
        extra: list[tuple[Any, ...] | None] = []
        for number, *_ in stored:
            keys = ((adapter,) if adapter is not None else ()) + (rest if number == 0 else ())
            extra.append(keys or None)
        return kv_events.block_stored(
            [key for _, key, _, _ in stored], stored[0][2], [t for *_, block in stored for t in block],
            self.block_tokens, adapter, extra if any(e is not None for e in extra) else None)

    def shrink(self, allowance: int) -> None:
        """Hold at most `allowance` blocks from now on: the least recently used past it are evicted, and on the host
        their pages go back to the OS (the running requests are about to use that memory)."""
        self.allowance = max(0, min(allowance, self.capacity))
        evicted: list[BlockKey] = []
        rows: list[int] = []
        while len(self.blocks) > self.allowance:
            key, entry = self.blocks.popitem(last=False)
            evicted.append(key)
            rows.append(entry.index)
        self.free += rows
        self._give_back(sorted(rows))
        if evicted and self.events is not None:
            self.events.append(kv_events.block_removed(evicted))

    def _give_back(self, rows: list[int]) -> None:
        """Drop the pages of these (sorted) rows, a run of consecutive rows at a time (a row of a small model can be
        less than a page; only whole pages go)."""
        if self.k.device.type != "cpu" or not rows:
            return  # device memory stays allocated; only the count matters there
        runs = _runs([(row, row) for row in rows])
        for pool in (self.k, self.v):
            layer_bytes, row_bytes = pool.stride(0) * pool.element_size(), pool.stride(1) * pool.element_size()
            for layer in range(pool.shape[0]):
                for first, _, count in runs:
                    give_back(pool.data_ptr() + layer * layer_bytes + first * row_bytes, count * row_bytes)

    def _take_row(self, chain: set[BlockKey]) -> int | None:
        if self.free and len(self.blocks) < self.allowance:
            return self.free.pop()
        oldest = next(iter(self.blocks), None)
        if oldest is None or oldest in chain:
            return None  # never evict the chain being stored: its first blocks are the useful ones
        if self.events is not None:
            self.events.append(kv_events.block_removed([oldest]))
        return self.blocks.pop(oldest).index  # least recently used; its children age out too

    def _copy(self, blocks: list[tuple[int, int]], slot: int, into_cache: bool) -> None:
        """Copy (block number in `slot`, pool row) pairs between the slot and the pool, one strided copy per
        run of consecutive numbers and rows. A chain stored in one go takes consecutive rows, so a 1.5k-token
        prefix is a handful of copies, each read and written once (a gather into a temporary, then a
        permuted copy, moved every byte three times: ~100 ms for 1.5k tokens on a 2-core box)."""
        b = self.block_tokens
        for number, row, count in _runs(blocks):
            if into_cache:
                self.cache.mark(slot, (number + count) * b)
            for pool, cache in ((self.k, self.cache.k), (self.v, self.cache.v)):
                positions = cache[:, slot, :, number * b : (number + count) * b].unflatten(2, (count, b))
                pooled = pool[:, row : row + count].permute(0, 2, 1, 3, 4)  # [L, H, count, B, D] like positions
                if into_cache:
                    positions.copy_(pooled)
                else:
                    pooled.copy_(positions)


def _runs(blocks: list[tuple[int, int]]) -> list[tuple[int, int, int]]:
    """(first block number, first pool row, length) of each run where both go up by one together."""
    runs: list[tuple[int, int, int]] = []
    for number, row in blocks:
        if runs and runs[-1][0] + runs[-1][2] == number and runs[-1][1] + runs[-1][2] == row:
            runs[-1] = (runs[-1][0], runs[-1][1], runs[-1][2] + 1)
        else:
            runs.append((number, row, 1))
    return runs
