"""KV cache memory on the host: a released slot reads zeros again; its pages stay resident, zeroed, within the
resident budget (the engine's KV budget), so the next prompt there takes no page faults, and go back to the OS
beyond it."""

from __future__ import annotations

import resource

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


def _fill(cache: KVCache, slot: int, end: int, value: float) -> None:
    cache.mark(slot, end)
    cache.k[:, slot, :, :end] = value
    cache.v[:, slot, :, :end] = value


def _faults_filling(cache: KVCache, slot: int, end: int) -> int:
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    _fill(cache, slot, end, 3.0)
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before


def test_within_the_budget_a_freed_slot_is_zeroed_in_place_and_refills_without_page_faults():
    process = psutil.Process()
    cache = _cache()
    pages = 2 * 4 * 2 * 4096 * 64 * 4 // 4096  # 4,096 positions of slot 0: 2,048 pages
    cache.release(0)  # no budget: slot 0's pages go back to the OS (calloc may have handed over mapped ones)
    assert _faults_filling(cache, 0, 4096) > 0.9 * pages  # so the first fill faults every page in
    cache.resident_budget = 3 * 8192
    filled = process.memory_info().rss
    cache.release(0, keep=1000)
    assert bool((cache.k[:, 0, :, :1000] == 3.0).all() and (cache.k[:, 0, :, 1000:] == 0).all())
    assert bool((cache.v[:, 0, :, 1000:] == 0).all())
    cache.release_all()
    assert bool((cache.k == 0).all() and (cache.v == 0).all())
    assert filled - process.memory_info().rss < 0.1 * pages * 4096  # still resident
    assert _faults_filling(cache, 0, 4096) < 0.05 * pages  # the next prompt writes to mapped pages
    cache.resident_budget = 0  # without the budget, as before: the pages go back and fault in again
    cache.release(0)
    assert _faults_filling(cache, 0, 4096) > 0.9 * pages


def test_past_the_budget_freed_pages_go_back():
    process = psutil.Process()
    cache = _cache()
    cache.resident_budget = 6000
    _fill(cache, 0, 4096, 1.0)
    _fill(cache, 1, 4096, 1.0)  # 8,192 resident positions, over the budget
    filled = process.memory_info().rss
    cache.release(1)
    slot_mb = 2 * 4 * 2 * 4096 * 64 * 4 / 2**20  # 16 MB
    assert filled - process.memory_info().rss > 0.8 * slot_mb * 2**20
    assert bool((cache.k[:, 1] == 0).all()) and cache.resident[1] == 0
    cache.release(0)  # 4,096 resident now: within the budget, kept
    assert cache.resident[0] == 4096 and bool((cache.k[:, 0] == 0).all())
