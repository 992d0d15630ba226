"""Which KV pool blocks are free, how many sequences hold each, and which cached ones may be reused.

The pool's blocks 1..total (block 0 is the cache's null block) are in one of three states:
- held: `refs[b]` sequences have it in their block table (a prefix-cache hit or an n/best_of fork shares a block
  by holding it again: no copy);
- free: no sequence holds it and it caches nothing; the most recently freed is taken first, so on the host the
  blocks in use stay on pages already mapped and resident memory follows the peak of blocks in use;
- idle: no sequence holds it but the prefix cache keys it (engine.core.prefix_cache); a new prompt that starts
  the same way may hold it again. Idle blocks are reused, least recently used first, only when no free block is
  left, and the prefix cache forgets each one as it goes (`on_evict`).

So free and idle blocks are both room (`available`): the prefix cache keeps only memory no running sequence needs,
as in vLLM's block pool (vllm/v1/core/block_pool.py) and nano-vllm's block manager.
"""

from __future__ import annotations

import collections
from collections.abc import Callable


class BlockPool:
    def __init__(self, total: int) -> None:
        self.total = total
        self.refs = [0] * (total + 1)
        self.refs[0] = 1  # the null block is never handed out
        self.free = list(range(total, 0, -1))  # a stack: the last freed is taken first
        self.idle: collections.OrderedDict[int, None] = collections.OrderedDict()  # least recently used first
        self.cached = [False] * (total + 1)
        self.on_evict: Callable[[int], None] | None = None  # the prefix cache forgets an idle block taken for reuse

    @property
    def available(self) -> int:
        """Blocks a sequence can take now: free ones, and idle cached ones (evicted as they are taken)."""
        return len(self.free) + len(self.idle)

    @property
    def used(self) -> int:
        """Blocks some sequence holds (what `kv_cache_usage_perc` reports)."""
        return self.total - self.available

    def take(self) -> int:
        """A block for one sequence to write: a free one, else the least recently used idle one."""
        if self.free:
            block = self.free.pop()
        elif self.idle:
            block, _ = self.idle.popitem(last=False)
            self.cached[block] = False
            if self.on_evict is not None:
                self.on_evict(block)
        else:
            raise RuntimeError("the KV pool has no block left (the scheduler admits only what fits)")
        self.refs[block] = 1
        return block

    def hold(self, block: int) -> None:
        """One more sequence holds `block` (a shared prefix or a fork)."""
        if self.refs[block] == 0:
            del self.idle[block]  # a cached block in use again
        self.refs[block] += 1

    def release(self, block: int) -> None:
        """One sequence gives `block` back."""
        self.refs[block] -= 1
        if self.refs[block] == 0:
            if self.cached[block]:
                self.idle[block] = None  # the most recently used idle block
            else:
                self.free.append(block)

    def set_cached(self, block: int, cached: bool) -> None:
        """The prefix cache keys `block` now, or no longer (an idle block it drops is free again)."""
        self.cached[block] = cached
        if not cached and block in self.idle:
            del self.idle[block]
            self.free.append(block)

    def oldest_idle(self) -> int | None:
        return next(iter(self.idle), None)
