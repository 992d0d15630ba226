"""Automatic prefix caching: exact (same tokens with or without a hit), safe (only identical token
sequences under the same adapter and image inputs share K/V), copy-free (a hit holds the cached blocks) and
bounded (LRU within its capacity, idle blocks yielding to running requests)."""

from __future__ import annotations

import copy

import pytest
import torch

from engine.core.block_pool import BlockPool
from engine.core.prefix_cache import PrefixCache
from engine.sampling_params import SamplingParams

from .engine_run import Run, greedy

HISTORY = [
    {"role": "system", "content": "You are a concise assistant who answers questions about geography and science."},
    {"role": "user", "content": "What is the capital of France?"},
    {"role": "assistant", "content": "The capital of France is Paris."},
    {"role": "user", "content": "And which river flows through it?"},
    {"role": "assistant", "content": "The Seine flows through Paris."},
]


@pytest.fixture(scope="module")
def turns(real_engine) -> dict[str, list[int]]:
    def render(question: str) -> list[int]:
        return real_engine.encode_prompt(messages=[*HISTORY, {"role": "user", "content": question}])

    return {"a": render("How long is that river?"), "b": render("Name a famous bridge over it."),
            "c": render("Why is the sky blue?"),
            "other": real_engine.encode_prompt(messages=[{"role": "user", "content": "Write a haiku about rain."}])}


@pytest.fixture
def cached_scheduler(real_engine):
    from engine.core.engine_core import EngineCore
    from engine.runner.model_runner import ModelRunner

    def make(capacity: int = 4096, slots: int = 8, budget: int | None = None):
        runner = ModelRunner(real_engine.runner.decoder, slots, 512)
        return EngineCore(runner, real_engine.sampler, real_engine.tokenizer, kv_budget_tokens=budget,
                          prefix_cache_tokens=capacity, check_invariants=True)

    return make


def cached(cache, tokens: list[int], salt) -> list[int]:
    """The pool blocks the prefix cache holds of a prompt (a peek)."""
    return cache.lookup(cache.prompt_chain(tokens, salt))


def run_one(sched, rid: str, prompt: list[int], params: SamplingParams) -> Run:
    run = Run(sched)
    run.add(rid, prompt, params)
    run.until_done()
    return run


def seeded() -> SamplingParams:
    return SamplingParams(temperature=0.8, seed=42, max_tokens=12, ignore_eos=True)


@pytest.mark.parametrize("params", [greedy(12, ignore_eos=True), seeded()], ids=["greedy", "seeded"])
def test_a_cache_hit_gives_the_same_tokens(make_scheduler, cached_scheduler, turns, params):
    reference = run_one(make_scheduler(), "b", turns["b"], copy.deepcopy(params))
    sched = cached_scheduler()
    run_one(sched, "a", turns["a"], copy.deepcopy(params))  # leaves the shared history in the cache
    hit = run_one(sched, "b", turns["b"], copy.deepcopy(params))
    shared = next(i for i, (x, y) in enumerate(zip(turns["a"], turns["b"], strict=False)) if x != y)
    cached = hit.final("b").cached_tokens
    assert shared - 16 < cached <= shared  # every full block of the shared history, nothing past it
    assert hit.ids("b") == reference.ids("b")


@pytest.mark.parametrize("params", [greedy(12, ignore_eos=True), seeded()], ids=["greedy", "seeded"])
def test_cache_hits_arriving_together_prefill_in_one_batch_and_give_the_same_tokens(make_scheduler, cached_scheduler,
                                                                                    turns, params):
    """A shared system prompt makes every request a hit: their rests run in one batched forward (each row
    from its own cached length), not one forward each, and the tokens equal a run with no cache at all."""
    names = ["b", "c", "other"]  # two hits on the shared history (different lengths cached) and one miss
    reference = {}
    for name in names:
        reference[name] = run_one(make_scheduler(), name, turns[name], copy.deepcopy(params)).ids(name)
    sched = cached_scheduler()
    run_one(sched, "a", turns["a"], greedy(1))  # leaves the shared history in the cache
    batches = []  # per step that prefills: each span's start
    step = sched.runner.step

    def spy(tokens, positions, adapters, spans):
        if spans:
            batches.append([span.start for span in spans])
        return step(tokens, positions, adapters, spans)

    sched.runner.step = spy
    run = Run(sched)
    for name in names:
        run.add(name, turns[name], copy.deepcopy(params))
    run.until_done()
    assert len(batches) == 1 and len(batches[0]) == 3  # one forward for the three prompts
    assert batches[0][0] > 0 and batches[0][1] > 0 and batches[0][2] == 0
    assert [run.final(n).cached_tokens for n in names] == batches[0]
    for name in names:
        assert run.ids(name) == reference[name], name


def test_a_finished_turn_caches_its_output_too(cached_scheduler, turns, real_engine):
    sched = cached_scheduler()
    first = run_one(sched, "a", turns["a"], greedy(24, ignore_eos=True))
    follow_up = turns["a"] + first.ids("a") + turns["c"][-6:]  # the next turn starts with this one's output
    again = run_one(sched, "f", follow_up, greedy(4, ignore_eos=True))
    assert again.final("f").cached_tokens > len(turns["a"])


def test_no_sharing_across_adapters_or_changed_tokens(cached_scheduler, turns):
    sched = cached_scheduler()
    run_one(sched, "a", turns["a"], greedy(2))
    cache = sched.scheduler.prefix_cache
    assert cached(cache, turns["a"], (None, None, None))
    assert not cached(cache, turns["a"], ("pirate", None, None))  # another adapter: other K/V
    assert not cached(cache, turns["a"], (None, "image-digest", None))  # image inputs are in the key
    assert not cached(cache, turns["a"], (None, None, "tenant"))  # and so is the tenant
    changed = list(turns["a"])
    changed[20] += 1  # block 1 differs: only block 0 may be shared
    assert len(cached(cache, changed, (None, None, None))) == 1


def test_a_tenant_hits_only_its_own_cached_prompts(cached_scheduler, turns):
    """The request's cache salt (the gateway's tenant) keys the blocks: the same prompt from another tenant is
    prefilled whole and reports no cached tokens, while the first tenant still hits."""
    from engine.request import EngineRequest

    sched = cached_scheduler()
    run = Run(sched)

    def ask(rid: str, salt: str | None) -> int:
        run.outputs[rid] = []
        sched.scheduler.add(EngineRequest(rid, turns["a"], greedy(2), run.outputs[rid].append, cache_salt=salt))
        run.until_done()
        return run.final(rid).cached_tokens

    assert ask("a1", "tenant-a") == 0
    assert ask("b1", "tenant-b") == 0
    assert ask("shared", None) == 0
    assert ask("a2", "tenant-a") > 0 and ask("b2", "tenant-b") > 0


def test_image_inputs_salt_the_key(make_scheduler):
    from engine.core.prefix_cache import salt_of
    from engine.core.sequence import SequenceGroup
    from engine.request import EngineRequest

    ids = list(range(1, 40))
    sched = make_scheduler()
    embeds = sched.runner.decoder.embed[torch.tensor(ids)].clone()
    other = embeds.clone()
    other[5] += 1.0
    salts = [salt_of(SequenceGroup(EngineRequest("x", ids, SamplingParams(), print, prompt_embeds=e)))
             for e in (embeds, embeds.clone(), other)]
    assert salts[0] == salts[1] != salts[2]


def test_lru_eviction_stays_within_the_capacity_and_takes_a_chain_s_tail_first(cached_scheduler, turns):
    sched = cached_scheduler(capacity=64)  # 4 blocks of 16 tokens, fewer than one prompt has
    cache = sched.scheduler.prefix_cache
    run_one(sched, "a", turns["a"], greedy(1))
    assert len(cache.entries) == 4
    assert len(cached(cache, turns["c"], (None, None, None))) == 4  # the shared history's first blocks
    run_one(sched, "o", turns["other"], greedy(1))  # an unrelated prompt: the least recently used go
    assert len(cache.entries) == 4
    assert cached(cache, turns["other"], (None, None, None))
    kept = len(cached(cache, turns["a"], (None, None, None)))
    assert 0 < kept < 4  # its tail went first: what stays is still a prefix a prompt can start with


def test_a_hit_holds_the_cached_blocks_themselves(cached_scheduler, turns):
    """A hit copies nothing: the new request's block table starts with the very blocks the first request's K/V
    were written to, each held once more while it runs, and they are the pool's again once it ends."""
    sched = cached_scheduler()
    scheduler = sched.scheduler
    run_one(sched, "a", turns["a"], greedy(2))
    cached = scheduler.prefix_cache.lookup(scheduler.prefix_cache.prompt_chain(turns["b"], (None, None, None)))
    assert cached
    run = Run(sched)
    run.add("b", turns["b"], greedy(8, ignore_eos=True))
    run.step()
    (row,) = scheduler.running
    assert row.blocks[: len(cached)] == cached
    assert list(scheduler.kv.cache.rows[row.slot, : len(cached)]) == cached
    assert all(scheduler.kv.pool.refs[b] == 1 for b in cached)
    run.until_done()
    assert scheduler.kv.pool.used == 0 and all(scheduler.kv.pool.refs[b] == 0 for b in cached)
    assert run.final("b").cached_tokens == len(cached) * 16


@pytest.mark.parametrize("together", [1, 2], ids=["alone", "batched"])
def test_a_prompt_is_stored_after_its_first_token_is_out(cached_scheduler, turns, together):
    """The store copies the prompt's K/V into the pool (6-21 ms for 1.5k tokens in fp32): after the first token is
    emitted, not on the way to it. Still stored: the next request with that prompt hits."""
    sched = cached_scheduler()
    run = Run(sched)
    store, seen = sched.scheduler.prefix_cache.store, []

    def recording_store(tokens, salt, slot, length):
        seen.append({rid: len(outputs) for rid, outputs in run.outputs.items()})
        store(tokens, salt, slot, length)

    sched.scheduler.prefix_cache.store = recording_store
    names = ["a", "b"][:together]
    for name in names:
        run.add(name, turns[name], greedy(6, ignore_eos=True))
    run.step()
    assert len(seen) == together and all(counts[n] >= 1 for counts in seen for n in names)
    run.until_done()
    again = run_one(sched, "again", turns["a"], greedy(2, ignore_eos=True))
    assert again.final("again").cached_tokens > 0


def test_idle_cached_blocks_are_reused_least_recently_used_first_and_removed_by_their_hashes():
    """A cached block no sequence holds is room: the pool takes its free blocks first, then the least recently used
    idle one, which the cache forgets with a BlockRemoved under the hash it was stored with."""
    pool = BlockPool(8)
    cache = PrefixCache(pool, capacity_tokens=8 * 16, block_tokens=16)
    cache.events = []
    first, second = list(range(100, 149)), list(range(300, 349))  # a lookup leaves the last token to prefill
    held = {}
    for name, tokens in (("first", first), ("second", second)):
        held[name] = [pool.take() for _ in range(3)]
        cache.store(tokens, None, held[name], length=48)  # 3 full blocks of 16
    assert [e["type"] for e in cache.events] == ["BlockStored", "BlockStored"]
    for name in ("first", "second"):
        for block in reversed(held[name]):
            pool.release(block)
    assert pool.used == 0 and pool.available == 8 and len(pool.idle) == 6
    assert cache.lookup(cache.prompt_chain(second, None)) == held["second"]
    pool.hold(held["second"][-1])  # held by a hit, then given back: the second is the most recently used
    pool.release(held["second"][-1])
    taken = [pool.take() for _ in range(3)]  # two free blocks, then the first chain's tail
    assert taken[2] == held["first"][2] and len(cache.entries) == 5
    assert cache.events[-1]["type"] == "BlockRemoved"
    assert cache.events[-1]["block_hashes"] == [cache.events[0]["block_hashes"][2]]
    assert cache.lookup(cache.prompt_chain(first, None)) == held["first"][:2]
    pool.hold(held["second"][0])  # a cached block in use again is not room
    assert pool.available == 4 and held["second"][0] not in pool.idle


def test_the_prefix_cache_holds_only_what_running_requests_leave(cached_scheduler, turns):
    """One KV memory: the running rows' blocks never pass the budget, the cached blocks nobody holds yield to them,
    and a finished conversation stays cached even when the running rows had filled the memory before it ended."""
    sched = cached_scheduler(capacity=4096, slots=4, budget=24 * 16)
    scheduler = sched.scheduler
    run = Run(sched)
    for rid in ("a", "b", "c", "other"):
        run.add(rid, turns[rid], greedy(40, ignore_eos=True))
    cache = scheduler.prefix_cache
    pool = scheduler.kv.pool
    for _ in range(500):
        if not scheduler.has_work():
            break
        run.step()
        held = {block for seq in scheduler.running for block in seq.blocks}
        assert len(held) == pool.used <= pool.total
    assert not scheduler.has_work()
    assert cache.entries  # the last finished ones stay cached once the memory is free
    again = run_one(sched, "again", turns["other"], greedy(2, ignore_eos=True))
    assert again.final("again").cached_tokens > 0
