"""KV cache memory on the host: a released slot's pages go back to the OS and read as zeros."""

from __future__ import annotations

import psutil
import torch

from engine.model.kv_cache import KVCache


def _cache() -> KVCache:
    return KVCache(layers=4, slots=3, kv_heads=2, max_len=8192, head_dim=64, dtype=torch.float32, device="cpu")


def test_release_keeps_the_first_positions_and_zeroes_the_rest():
    cache = _cache()
    cache.k.fill_(1.5)
    cache.v.fill_(-2.0)
    cache.release(1, keep=100)  # 100 positions of 256 bytes: the page holding position 99 stays
    assert bool((cache.k[:, 1, :, :100] == 1.5).all() and (cache.v[:, 1, :, :100] == -2.0).all())
    assert bool((cache.k[:, 1, :, 112:] == 0).all() and (cache.v[:, 1, :, 112:] == 0).all())
    for other in (0, 2):
        assert bool((cache.k[:, other] == 1.5).all() and (cache.v[:, other] == -2.0).all())
    cache.release(2)
    assert bool((cache.k[:, 2] == 0).all() and (cache.v[:, 2] == 0).all())


def test_released_memory_leaves_the_process():
    process = psutil.Process()
    cache = _cache()
    slot_mb = 2 * 4 * 2 * 8192 * 64 * 4 / 2**20  # 32 MB
    cache.k[:, 0] = 1.0
    cache.v[:, 0] = 1.0  # resident now (fresh pages, or heap pages calloc reused and zeroed)
    filled = process.memory_info().rss / 2**20
    cache.release(0)
    assert filled - process.memory_info().rss / 2**20 > 0.8 * slot_mb
    cache.k[:, 1] = 1.0
    cache.release_all()
    assert bool((cache.k == 0).all() and (cache.v == 0).all())
