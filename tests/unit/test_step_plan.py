"""The scheduler's step plans, without a model (tests/unit/scheduler_harness.py): which sequences compute which
tokens, preemption and return through the prompt path, and the two cases that once lost a request or preempted one
just admitted. Every scheduler here checks its invariants after every step."""

from __future__ import annotations

import pytest

from engine.core.invariants import check_invariants
from engine.core.kv_manager import BLOCK_TOKENS, InvariantBroken

from .scheduler_harness import add, assert_pool_whole, prompt_of, rid, run, scheduler, step, until_idle


def spans(plan) -> list[tuple[str, int, int, bool, int]]:
    return [(s.seq.group.request.request_id, s.start, s.end, s.sample, s.slot) for s in plan.spans]


def test_short_prompts_prefill_in_one_plan_and_decode_from_the_next():
    sched = scheduler()
    add(sched, "a", 20)
    add(sched, "b", 30)
    plan = sched.schedule()
    assert plan.decode == []
    assert spans(plan) == [("a", 0, 20, True, 0), ("b", 0, 30, True, 1)]
    run(sched, plan)
    plan = sched.schedule()
    assert rid(plan.decode) == ["a", "b"] and plan.spans == []
    assert [s.num_computed for s in plan.decode] == [20, 30]  # each feeds its first token at the end of its prompt
    assert [s.slot for s in plan.decode] == [0, 1]


def test_the_token_budget_counts_the_decode_rows_and_chunks_a_long_prompt():
    sched = scheduler(budget=64)
    add(sched, "short", 10)
    step(sched)
    add(sched, "long", 150)
    seen = []
    for _ in range(3):
        plan = sched.schedule()
        assert rid(plan.decode) == ["short"]  # never held back by the prefill
        seen += spans(plan)
        run(sched, plan)
    assert seen == [("long", 0, 63, False, 1), ("long", 63, 126, False, 1), ("long", 126, 150, True, 1)]
    assert rid(sched.schedule().decode) == ["short", "long"]


def test_a_finished_prompt_leaves_its_budget_to_the_next_and_forks_its_candidates():
    sched = scheduler(budget=64)
    add(sched, "pair", 100, n=2)
    add(sched, "next", 80)
    step(sched)  # pair 0..64
    plan = sched.schedule()
    assert spans(plan) == [("pair", 64, 100, True, 0), ("next", 0, 28, False, 1)]
    sampled = run(sched, plan)
    assert rid(sampled) == ["pair", "pair"]  # both candidates sample from the prompt's logits
    parent, child = sched.requests[id(sampled[0].group)].sequences
    assert child.blocks[:6] == parent.blocks[:6] and child.blocks[6] != parent.blocks[6]  # the partial block copied
    plan = sched.schedule()
    assert rid(plan.decode) == ["pair", "pair"] and spans(plan) == [("next", 28, 80, True, 2)]


def test_when_blocks_run_out_the_newest_returns_through_the_prompt_path_from_its_cached_blocks():
    sched = scheduler(blocks=8, budget=256, prefix_cache=True)  # 128 positions; each request grows to 100
    add(sched, "old", 40, max_tokens=60)
    out_new = add(sched, "new", 40, max_tokens=60)
    step(sched)
    for _ in range(60):
        plan = step(sched)
        if plan.preempted:
            break
    assert plan.preempted == 1 and rid(plan.decode) == ["old"] and rid(sched.waiting) == ["new"]
    (new,) = sched.waiting
    streamed = list(new.output_ids)
    plan = sched.schedule()
    while not plan.spans:  # the old one runs alone until it ends
        assert rid(plan.decode) == ["old"]
        run(sched, plan)
        plan = sched.schedule()
    (span,) = plan.spans  # it came back: one span of its prompt and every token it streamed, from cached blocks
    assert span.seq is new
    assert span.start > 0 and span.start % BLOCK_TOKENS == 0 and span.sample
    assert span.end == 40 + len(streamed)
    run(sched, plan)
    assert new.output_ids[: len(streamed)] == streamed  # nothing lost, nothing sent twice
    until_idle(sched)
    assert_pool_whole(sched)
    assert out_new[-1].final
    assert sched.stats.prefix_hits <= sched.stats.prefix_queries
    assert sched.stats.prefix_hits >= span.start  # the return's hits are counted


def test_a_request_whose_prefix_is_evicted_between_sizing_and_allocation_is_not_lost():
    """A 16-block pool, a 40-token budget, the prefix cache on. B0's 64-token prompt has finished and a long request
    after it: their blocks are idle, B0's the least recently used. Then A and B (B0's prompt + 2 tokens) arrive
    together. Taking blocks for A must not evict the cached prefix B was sized with: B once ended up neither
    waiting nor running, and its blocks were never given back."""
    sched = scheduler(slots=8, blocks=16, budget=40, prefix_cache=True)
    shared = prompt_of("B0", 64)
    add(sched, "B0", shared + [7], max_tokens=1)
    until_idle(sched)
    add(sched, "long", 139, max_tokens=37)
    until_idle(sched)
    assert sched.kv.pool.available == 16 and len(sched.kv.pool.idle) >= 12
    out_a = add(sched, "A", 34, max_tokens=8)
    out_b = add(sched, "B", shared + prompt_of("B", 2), max_tokens=4)
    until_idle(sched)
    assert out_a[-1].final and out_b[-1].final
    assert_pool_whole(sched)


def test_a_request_admitted_into_the_last_blocks_is_not_preempted_by_the_next_step():
    """Admission keeps the blocks the running rows take at the next decode step, and a watermark: in a 6-block pool
    a request whose prompt fits the blocks left, but not also the running row's next one, waits instead of being
    admitted and preempted one step later."""
    sched = scheduler(slots=4, blocks=6, budget=64)
    add(sched, "old", 25, max_tokens=12)
    for _ in range(7):
        step(sched)
    add(sched, "new", 54, max_tokens=25)
    while sched.has_work():
        assert step(sched).preempted == 0
    assert_pool_whole(sched)


def test_a_returning_prompt_counts_its_hits_once_per_lookup_and_never_above_the_queries():
    sched = scheduler(blocks=10, budget=512, prefix_cache=True)
    add(sched, "long", 40, max_tokens=100)
    add(sched, "b", 20, max_tokens=70)
    add(sched, "c", 20, max_tokens=70)
    until_idle(sched)
    assert sched.stats.preemptions >= 1
    assert 0 < sched.stats.prefix_hits <= sched.stats.prefix_queries
    assert_pool_whole(sched)


def test_a_request_whose_span_failed_leaves_the_others_running():
    sched = scheduler()
    add(sched, "a", 20)
    add(sched, "b", 20)
    add(sched, "c", 20)
    plan = sched.schedule()
    failed = plan.spans[1].seq.group
    sched.abort(failed, "error")
    rows, widths = sched.complete([], [plan.spans[0], plan.spans[2]])
    assert rid(rows) == ["a", "c"] and widths == [1, 1]
    for seq in rows:
        seq.record_token(7, 0.0)
    sched.end_step()
    assert sched.kv.pool.used == 2 * 2  # "b" gave its blocks back; each of the others holds 2
    assert rid(sched.schedule().decode) == ["a", "c"]


def test_several_prompts_chunk_at_once_when_partial_prefills_are_allowed():
    sched = scheduler(budget=64, partial=2)
    add(sched, "long", 200, max_tokens=1)
    add(sched, "short", 20, max_tokens=1)
    plan = sched.schedule()
    assert spans(plan) == [("long", 0, 32, False, 0), ("short", 0, 20, True, 1)]  # the short one starts at once


def test_the_invariant_check_catches_a_lost_request_and_a_leaked_block():
    sched = scheduler()
    add(sched, "a", 20)
    add(sched, "b", 20)
    step(sched)

    def check() -> None:
        check_invariants(sched.running, sched.waiting, sched.requests, sched.kv)

    check()
    lost = sched.running.pop()  # neither waiting nor running, still holding its blocks
    with pytest.raises(InvariantBroken, match="neither waiting nor running"):
        check()
    sched.running.append(lost)
    check()
    sched.kv.pool.take()  # a block no running sequence holds
    with pytest.raises(InvariantBroken, match="reference count"):
        check()
