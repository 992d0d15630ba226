"""Automatic prefix caching: past prompts' (and finished outputs') K/V blocks, found again by their tokens.

A prompt is cut into blocks of `block_tokens`; block i is keyed by the chain (key of block i-1, its own tokens),
rooted in a salt that carries everything else the K/V depends on (the LoRA adapter, a digest of the image inputs,
the tenant). The cache keys blocks of the KV pool itself (engine.core.block_pool): a sequence's full blocks are
keyed once their K/V is written (a prompt after its first token, a finished answer as it retires), and a new
request whose prompt starts the same way holds those same blocks in its own block table and prefills only the
rest. Nothing is copied either way. Entries keep their tokens and parent key, so a hash collision can never share
K/V between different token sequences.

A keyed block no sequence holds is idle: it stays until the pool needs the room (least recently used first) or
the cache is over `capacity_tokens`, and the cache forgets it then. So the cache holds only memory no running
request needs, as vLLM's prefix caching does (docs/kv-memory.md).

A key is a 64-bit keyed BLAKE2b of the parent's key and the block's tokens, keyed by the salt: stable across
processes, so the keys this cache reports in its KV events (engine.core.kv_events, when `events` is a list) mean the
same thing to a router after a restart. The salt is (LoRA adapter, then whatever else the K/V depends on).
"""

from __future__ import annotations

import hashlib
from array import array
from dataclasses import dataclass
from typing import Any

from engine.core import kv_events
from engine.core.block_pool import BlockPool
from engine.core.sequence import SequenceGroup

BlockKey = int


def salt_of(group: SequenceGroup) -> object:
    """What a request's K/V depends on besides the token ids: the adapter and the image inputs; and whose it is: the
    request's tenant salt, so one tenant's prompts never hit (nor time) another's blocks. Made once a request."""
    if group.cache_salt is None:
        embeds = group.request.prompt_embeds
        digest = None
        if embeds is not None:
            digest = hashlib.blake2b(embeds.detach().float().cpu().numpy().tobytes(), digest_size=16).hexdigest()
        group.cache_salt = (group.params.lora_adapter, digest, group.request.cache_salt)
    return group.cache_salt


@dataclass
class _Block:
    block: int  # the pool block holding its K/V
    parent: BlockKey | None
    tokens: tuple[int, ...]


class PrefixCache:
    def __init__(self, pool: BlockPool, capacity_tokens: int, block_tokens: int = 16) -> None:
        self.pool = pool
        pool.on_evict = self._forget
        self.block_tokens = block_tokens
        self.capacity = max(capacity_tokens // block_tokens, 0)  # keyed blocks, held or idle
        self.entries: dict[BlockKey, _Block] = {}
        self.key_of: dict[int, BlockKey] = {}  # pool block -> its key
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

    def prompt_chain(self, tokens: list[int], salt: object) -> list[tuple[BlockKey, BlockKey | None, tuple[int, ...]]]:
        """The keys `lookup` walks for these tokens: each full block's but the one holding the last token, whose
        logits start the generation, so a hit always leaves at least that token to compute."""
        return list(self._chain(tokens, salt, len(tokens) - 1))

    def lookup(self, chain: list[tuple[BlockKey, BlockKey | None, tuple[int, ...]]]) -> list[int]:
        """Pool blocks of the longest cached run of `chain` (a `prompt_chain`) from its start. A peek: nothing is
        held, counted or moved (the KV manager holds the hits it allocates)."""
        found: list[int] = []
        for key, parent, block in chain:
            entry = self.entries.get(key)
            if entry is None or entry.parent != parent or entry.tokens != block:
                break
            found.append(entry.block)
        return found

    def store(self, tokens: list[int], salt: object, blocks: list[int], length: int) -> None:
        """Key the full blocks among the first `length` positions of a sequence whose block table is `blocks`
        (their K/V written)."""
        run: list[tuple[int, BlockKey, BlockKey | None, tuple[int, ...]]] = []  # newly keyed, consecutive
        for number, (key, parent, block) in enumerate(self._chain(tokens, salt, length)):
            entry = self.entries.get(key)
            if entry is not None:
                if entry.parent != parent or entry.tokens != block:
                    break  # a 64-bit collision: never share K/V between different tokens
                self._announce(run, salt)  # already cached (this very block, or the same tokens elsewhere)
                run = []
                continue
            own = blocks[number]
            if own in self.key_of or not self._room():
                break
            self.entries[key] = _Block(own, parent, block)
            self.key_of[own] = key
            self.pool.set_cached(own, True)
            run.append((number, key, parent, block))
        self._announce(run, salt)

    def _announce(self, run: list[tuple[int, BlockKey, BlockKey | None, tuple[int, ...]]], salt: object) -> None:
        """One BlockStored for a run of consecutive newly keyed blocks (a chain, from its first one's parent)."""
        if self.events is not None and run:
            self.events.append(self._stored_event(run, salt))

    def _room(self) -> bool:
        """Whether one more block may be keyed: under capacity, or after forgetting the least recently used idle
        one (a held block stays keyed while it is in use)."""
        if len(self.entries) < self.capacity:
            return True
        oldest = self.pool.oldest_idle()
        if oldest is None:
            return False
        self._forget(oldest)
        self.pool.set_cached(oldest, False)
        return True

    def _forget(self, block: int) -> None:
        """`block` is no longer cached (evicted for reuse, or over capacity): its entry goes, with a BlockRemoved."""
        key = self.key_of.pop(block)
        del self.entries[key]
        if self.events is not None:
            self.events.append(kv_events.block_removed([key]))

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
