"""The KV block pool and the prefix cache over it, without a model: reference counts, free and idle blocks, LRU
reuse, hash chains and their collisions, forks that share, and no block leaked after any sequence of operations
(random runs by hypothesis)."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from engine.core.block_pool import BlockPool
from engine.core.prefix_cache import PrefixCache

B = 16


def test_the_most_recently_freed_block_is_taken_first_and_the_null_block_never():
    pool = BlockPool(4)
    taken = [pool.take() for _ in range(4)]
    assert taken == [1, 2, 3, 4] and pool.available == 0 and pool.used == 4
    pool.release(3)
    pool.release(1)
    assert pool.take() == 1 and pool.take() == 3  # pages already mapped are written again first


def test_a_shared_block_is_free_only_when_its_last_holder_gives_it_back():
    pool = BlockPool(2)
    block = pool.take()
    pool.hold(block)
    pool.release(block)
    assert pool.used == 1
    pool.release(block)
    assert pool.used == 0 and pool.available == 2


def test_a_collision_never_shares_kv_between_different_tokens():
    pool = BlockPool(8)
    cache = PrefixCache(pool, 8 * B, B)
    tokens = list(range(100, 133))
    blocks = [pool.take(), pool.take()]
    cache.store(tokens, None, blocks, 32)
    key = next(iter(cache.entries))
    cache.entries[key].tokens = (0,) * B  # as if another token run had hashed to this key
    assert cache.lookup(cache.prompt_chain(tokens, None)) == []
    other = [pool.take(), pool.take()]
    cache.store(tokens, None, other, 32)  # nothing is keyed over the colliding entry
    assert other[0] not in cache.key_of


def test_over_capacity_the_least_recently_used_idle_block_is_forgotten_and_a_held_one_kept():
    pool = BlockPool(8)
    cache = PrefixCache(pool, 2 * B, B)
    cache.events = []
    first = [pool.take(), pool.take()]
    cache.store(list(range(33)), None, first, 32)
    second = [pool.take(), pool.take()]
    cache.store(list(range(50, 83)), None, second, 32)  # both of first are held: nothing may go
    assert set(cache.key_of) == set(first)
    for block in reversed(first):
        pool.release(block)
    cache.store(list(range(50, 83)), None, second, 32)  # now first's idle tail, then its root, make room
    assert set(cache.key_of) == set(second) and pool.available == 8 - 2
    assert [e["type"] for e in cache.events] == ["BlockStored", "BlockRemoved", "BlockRemoved", "BlockStored"]


@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(st.sampled_from(["start", "grow", "fork", "finish", "drop"]), st.integers(0, 7),
                          st.integers(1, 40)), max_size=60))
def test_no_block_is_leaked_or_shared_wrongly_after_any_run(ops):
    """Sequences start (maybe from a cached prefix), grow, fork, finish (their blocks keyed) and are dropped, in any
    order: the pool's counts always equal the sequences' own, a keyed block is either held or idle, and when every
    sequence is gone every block is available again."""
    pool = BlockPool(24)
    cache = PrefixCache(pool, 12 * B, B)
    seqs: list[tuple[list[int], list[int]]] = []  # (tokens, blocks)

    def grow(seq: tuple[list[int], list[int]], tokens: list[int]) -> bool:
        need = -(-len(tokens) // B) - len(seq[1])
        if need > pool.available:
            return False
        seq[0].extend(tokens[len(seq[0]):])
        seq[1].extend(pool.take() for _ in range(need))
        return True

    for op, pick, size in ops:
        if op == "start":
            tokens = [pick % 3] * B + list(range(size))  # three families of prompts that share a first block
            held = cache.lookup(cache.prompt_chain(tokens, None))
            for block in held:
                pool.hold(block)
            seq = (tokens[: len(held) * B], list(held))
            if grow(seq, tokens):
                seqs.append(seq)
            else:
                for block in reversed(seq[1]):
                    pool.release(block)
        elif not seqs:
            continue
        elif op == "grow":
            seq = seqs[pick % len(seqs)]
            grow(seq, seq[0] + list(range(1000, 1000 + size)))
        elif op == "fork":
            tokens, blocks = seqs[pick % len(seqs)]
            full = len(tokens) // B
            child_blocks = blocks[:full]
            if len(tokens) % B and pool.available < 1:
                continue
            for block in child_blocks:
                pool.hold(block)
            if len(tokens) % B:
                child_blocks = child_blocks + [pool.take()]
            seqs.append((list(tokens), child_blocks))
        else:
            tokens, blocks = seqs.pop(pick % len(seqs))
            if op == "finish":
                cache.store(tokens, None, blocks, len(tokens))
            for block in reversed(blocks):
                pool.release(block)
        held: dict[int, int] = {}
        for _, blocks in seqs:
            for block in blocks:
                held[block] = held.get(block, 0) + 1
        assert all(pool.refs[b] == held.get(b, 0) for b in range(1, 25))
        assert pool.used == len(held) and pool.available == 24 - len(held)
        assert all(b in held or b in pool.idle for b in cache.key_of) and len(cache.entries) <= 12
        assert set(pool.idle) <= set(cache.key_of) and not set(pool.free) & set(held)
    for _, blocks in seqs:
        for block in reversed(blocks):
            pool.release(block)
    assert pool.used == 0 and pool.available == 24 and sorted(pool.free + list(pool.idle)) == list(range(1, 25))
