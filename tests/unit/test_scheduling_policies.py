"""The waiting queue's policies without a model (tests/unit/scheduler_harness.py): fcfs, priority and fair."""

from __future__ import annotations

from .scheduler_harness import add, assert_pool_whole, rid, run, scheduler, step, until_idle


def test_fcfs_never_preempts_for_a_waiting_request():
    sched = scheduler(slots=2, policy="fcfs")
    for name in ("a", "b"):
        add(sched, name, 20, max_tokens=50)
    step(sched)
    add(sched, "urgent", 20, max_tokens=5, priority=-10)  # fcfs reads no priority
    for _ in range(10):
        assert step(sched).preempted == 0
    assert "urgent" in rid(sched.waiting)


def test_a_better_priority_takes_the_place_of_the_worst_running_one_when_the_batch_is_full():
    sched = scheduler(slots=2, policy="priority")
    add(sched, "low", 20, max_tokens=50, priority=5)
    add(sched, "normal", 20, max_tokens=50)
    step(sched)
    add(sched, "urgent", 20, max_tokens=5, priority=-1)
    plan = sched.schedule()
    assert plan.preempted == 1 and rid(sched.waiting) == ["low"]  # the worst gave way, not the newest
    assert rid(plan.decode) == ["normal"] and rid([span.seq for span in plan.spans]) == ["urgent"]
    run(sched, plan)
    until_idle(sched)
    assert sched.stats.preemptions_by_cause == {"kv": 0, "priority": 1}
    assert_pool_whole(sched)


def test_equal_or_lower_priority_never_preempts():
    sched = scheduler(slots=2, policy="priority")
    add(sched, "a", 20, max_tokens=30)
    add(sched, "b", 20, max_tokens=60)
    step(sched)
    add(sched, "same", 20, max_tokens=5)
    add(sched, "lower", 20, max_tokens=5, priority=3)
    while len(sched.waiting) == 2:
        assert step(sched).preempted == 0
    assert rid(sched.waiting) == ["lower"]  # a row freed: the better of the two waiting went first
    until_idle(sched)


def test_when_blocks_run_out_the_lowest_priority_gives_way_first():
    sched = scheduler(slots=4, blocks=10, budget=256, policy="priority")  # 160 positions
    add(sched, "background", 40, max_tokens=80, priority=2)
    add(sched, "interactive", 40, max_tokens=80)
    step(sched)  # both admitted: the background one first, so the newest is the interactive one
    while not sched.stats.preemptions:
        step(sched)
    assert rid(sched.waiting) == ["background"]
    until_idle(sched)
    assert_pool_whole(sched)


def test_under_fair_a_light_tenant_is_not_queued_behind_a_heavy_tenants_flood():
    def light_waits(policy: str) -> int:
        sched = scheduler(slots=4, blocks=200, budget=256, policy=policy)
        for i in range(12):  # the heavy tenant keeps three times the rows busy
            add(sched, f"heavy{i}", 30, max_tokens=200, tenant="A")
        for _ in range(30):
            step(sched)
        add(sched, "light", 20, max_tokens=4, tenant="B")
        steps = 0
        while "light" not in [s.group.request.request_id for s in sched.running] and steps < 400:
            step(sched)
            steps += 1
        until_idle(sched)
        assert_pool_whole(sched)
        return steps

    assert light_waits("fcfs") > 100  # behind every heavy request: rows free only as they finish
    assert light_waits("fair") <= 2  # A holds every row: as soon as it has served more, one row is B's


def test_fair_lifts_a_returning_tenant_and_forgets_tenants_no_longer_in_flight():
    sched = scheduler(slots=2, blocks=100, budget=128, policy="fair")
    add(sched, "a1", 20, max_tokens=40, tenant="A")
    for _ in range(20):
        step(sched)
    queue = sched.waiting
    served_a = queue.counters["A"]
    assert served_a >= 20 + 2 * 19  # its prompt once, then two a token
    add(sched, "b1", 20, max_tokens=2, tenant="B")
    assert queue.counters["B"] == served_a  # no credit for having been idle
    until_idle(sched)
    assert queue.counters == {}  # nothing in flight: no counter kept
    assert_pool_whole(sched)


def test_fair_weights_divide_the_service_counted():
    sched = scheduler(slots=4, blocks=100, budget=128, policy="fair")
    add(sched, "a", 16, max_tokens=10, tenant="A")
    add(sched, "b", 16, max_tokens=10, tenant="B", weight=2.0)
    for _ in range(5):
        step(sched)
    counters = sched.waiting.counters
    assert counters["A"] == 2 * counters["B"]


def _preempt_a_long_answer(policy: str = "fcfs"):
    """Two long answers in a pool of 10 blocks: the newer one is preempted once it has streamed, and cannot come
    back until the older one ends."""
    sched = scheduler(slots=4, blocks=10, budget=256, policy=policy)
    add(sched, "older", 40, max_tokens=100)
    add(sched, "newer", 40, max_tokens=100)
    while not sched.stats.preemptions:
        step(sched)
    assert rid(sched.waiting) == ["newer"] and sched.waiting.peek().output_ids
    return sched


def test_a_new_request_gets_its_first_token_before_a_preempted_stream_returns():
    """Under a load several times the pool, strict arrival order kept new chats behind preempted long answers
    until those could come back whole: past the gateway's first-chunk timeout. The new one goes first."""
    sched = _preempt_a_long_answer()
    add(sched, "chat", 16, max_tokens=5)
    for _ in range(2):
        step(sched)
    started = [seq for seq in sched.running if seq.output_ids]
    assert "chat" in rid(started), "the new request is still waiting behind the preempted one"
    assert "newer" in rid(sched.waiting)  # the preempted stream waits; its turn comes
    until_idle(sched)
    assert_pool_whole(sched)


def test_a_preempted_stream_passed_over_bypass_limit_times_goes_first(monkeypatch):
    monkeypatch.setattr("engine.core.waiting_queue.BYPASS_LIMIT", 2)
    sched = _preempt_a_long_answer()
    for i in range(3):
        add(sched, f"chat{i}", 16, max_tokens=2)
    assert rid(sched.waiting) == ["chat0", "chat1", "chat2", "newer"]
    while "chat1" in rid(sched.waiting):
        step(sched)
    assert rid(sched.waiting) == ["newer", "chat2"]  # due: nothing passes it again until it fits
    until_idle(sched)
    assert_pool_whole(sched)
