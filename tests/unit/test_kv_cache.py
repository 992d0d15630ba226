"""The paged KV cache (engine.model.kv_cache): positions land in the block and offset their table says, a gather
reads them back in position order whatever blocks hold them, and on the host a pool sized for a whole profile costs
memory only where blocks have been written."""

from __future__ import annotations

import psutil
import torch

from engine.model.kv_cache import NULL_BLOCK, KVCache


def _cache(**kw) -> KVCache:
    return KVCache(layers=2, slots=3, kv_heads=2, max_len=64, head_dim=8, dtype=torch.float32, device="cpu", **kw)


def test_a_new_cache_gives_each_slot_its_own_blocks_until_a_scheduler_clears_the_tables():
    cache = _cache()
    assert cache.num_blocks == 3 * 4 + 1 and cache.max_blocks == 4
    owned = cache.rows.flatten().tolist()
    assert sorted(owned) == list(range(1, 13))  # every block once, none the null block
    cache.clear_tables()
    assert not cache.rows.any()
    small = _cache(num_blocks=5)  # too few for every slot's context: no slot owns any block yet
    assert small.k.shape[1] == 5 and (small.rows == NULL_BLOCK).all()


def test_writes_land_where_the_table_says_and_a_gather_reads_them_back_in_order():
    cache = _cache()
    cache.clear_tables()
    cache.rows[1, :3] = [9, 2, 5]  # slot 1's positions 0..47 in scattered blocks
    positions = torch.arange(40)
    k = torch.randn(40, 2, 8)
    v = torch.randn(40, 2, 8)
    block, offset = cache.locate(cache.tables[1], positions)
    assert block.tolist() == [9] * 16 + [2] * 16 + [5] * 8 and offset.tolist() == list(range(16)) * 2 + list(range(8))
    cache.write(1, block, offset, k, v)
    assert torch.equal(cache.k[1, 2, :, 3], k[19])  # position 19: block 2, offset 3
    keys, values = cache.gather(1, cache.tables[[1]], 40)
    assert torch.equal(keys[0], k.transpose(0, 1)) and torch.equal(values[0], v.transpose(0, 1))
    rows = cache.tables[[1, 1]]  # a table per position: the same answer
    assert torch.equal(cache.locate(rows, torch.tensor([19, 33]))[0], torch.tensor([2, 5]))


def test_copy_block_copies_every_layer():
    cache = _cache()
    cache.k.normal_()
    cache.v.normal_()
    cache.copy_block(4, 7)
    assert torch.equal(cache.k[:, 7], cache.k[:, 4]) and torch.equal(cache.v[:, 7], cache.v[:, 4])


def test_a_pool_costs_memory_only_where_blocks_are_written():
    process = psutil.Process()
    before = process.memory_info().rss
    cache = KVCache(layers=4, slots=64, kv_heads=2, max_len=8192, head_dim=64, dtype=torch.float32, device="cpu")
    virtual = cache.k.numel() * 4 * 2
    assert virtual > 2**30  # 2 GiB of K/V for 64 slots of 8k positions
    assert process.memory_info().rss - before < 64 * 2**20
    cache.k[:, 1:65] = 1.0  # 64 blocks written
    cache.v[:, 1:65] = 1.0
    grown = process.memory_info().rss - before
    written = 2 * 4 * 64 * 2 * 16 * 64 * 4  # 4 MiB
    assert written * 0.8 < grown < written + 64 * 2**20
