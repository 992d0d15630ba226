"""KV admission without reservations, and preemption by recompute, on a synchronous scheduler.

Each test sets a small KV budget on its scheduler. A request is admitted when its prompt's blocks fit (engine.core.
slots); nothing is held for tokens not yet generated, and when running rows outgrow the budget the newest is
preempted and later recomputed from its prompt and the tokens it has streamed.
"""

from __future__ import annotations

import time

import pytest

from engine.core.kv_manager import BLOCK_TOKENS
from engine.core.output_processor import PREEMPTED_HEARTBEAT_S
from engine.core.sequence import Sequence
from engine.errors import EngineError
from engine.sampling_params import SamplingParams

from .engine_run import PROMPTS, Run, greedy


@pytest.fixture(scope="module")
def prompt(real_engine) -> list[int]:
    return real_engine.encode_prompt(messages=[{"role": "user", "content": "Tell me a long story."}])


def long_run(n: int, max_tokens: int, seed: int = 3) -> SamplingParams:
    return SamplingParams(temperature=1.0, seed=seed, n=n, max_tokens=max_tokens, ignore_eos=True)


def with_budget(make_scheduler, tokens: int, prefix_cache_tokens: int = 0, **kwargs) -> Run:
    """A synchronous engine whose KV pool holds `tokens` positions (its invariants checked after every step)."""
    return Run(make_scheduler(kv_budget_tokens=tokens, prefix_cache_tokens=prefix_cache_tokens, **kwargs))


def until_done_within_budget(run: Run, max_steps: int = 2000) -> None:
    """Step to the end (the scheduler checks after every step that each block held is a running sequence's and
    the pool's counts add up), and check at the end that every block came back."""
    sched = run.sched.scheduler
    for _ in range(max_steps):
        if not sched.has_work():
            assert sched.kv.pool.used == 0 and sched.kv.pool.available == sched.kv.total_blocks
            assert not sched.requests
            return
        run.step()
    raise AssertionError("scheduler did not finish")


def preempted(run: Run) -> list[Sequence]:
    """Candidates waiting to come back after a preemption."""
    return [seq for seq in run.sched.scheduler.waiting if seq.group.admission >= 0]


def until_preempted(run: Run, limit: int = 400) -> Sequence:
    """Step until a candidate is preempted; returns it (the only one)."""
    for _ in range(limit):
        run.step()
        if preempted(run):
            (seq,) = preempted(run)
            return seq
    raise AssertionError(f"nothing was preempted in {limit} steps")


def test_a_request_over_half_the_budget_runs_to_its_end(make_scheduler, prompt):
    """A reservation of n x (prompt + max_tokens) over half the budget used to be a 400; it fits as it grows."""
    run = with_budget(make_scheduler, 512)
    assert 2 * (len(prompt) + 200) > 512 // 2
    run.add("big", prompt, long_run(2, 200))
    until_done_within_budget(run)
    assert [o.finish_reason for o in run.finals("big")] == ["length"]
    assert len(run.ids("big", 0)) == len(run.ids("big", 1)) == 200


def test_refused_only_what_could_never_run(make_scheduler, prompt):
    run = with_budget(make_scheduler, 8 * BLOCK_TOKENS)
    with pytest.raises(EngineError) as info:  # one candidate alone at its longest passes the whole budget
        run.add("long", prompt, long_run(1, 200))
    assert (info.value.code, info.value.param) == ("invalid_request", "max_tokens")
    with pytest.raises(EngineError) as info:  # its prompts alone, one per candidate, pass the budget
        run.add("wide", prompt, long_run(8 * BLOCK_TOKENS // len(prompt) + 1, 4))
    assert (info.value.code, info.value.param) == ("invalid_request", "n")
    assert "KV memory" in info.value.message
    run.add("fits", prompt, long_run(1, 7 * BLOCK_TOKENS - len(prompt)))  # its last position fills block 7
    until_done_within_budget(run)
    assert run.final("fits").finish_reason == "length"


def test_preempted_candidates_end_with_the_tokens_they_would_have_had(make_scheduler, real_engine):
    """Greedy, seeded and n=2 requests on a budget far too small for all of them at once: the newest are
    preempted and recomputed, and every candidate's tokens and streamed text equal the same request alone."""
    prompts = [real_engine.encode_prompt(messages=[{"role": "user", "content": p}]) for p in PROMPTS]
    params = [greedy(40, ignore_eos=True), long_run(1, 40, seed=11), long_run(2, 40, seed=5),
              greedy(40, ignore_eos=True)]
    alone = {}
    for i, (ids, p) in enumerate(zip(prompts, params, strict=True)):
        solo = Run(make_scheduler())
        solo.add(f"r{i}", ids, p)
        solo.until_done()
        alone[f"r{i}"] = [(solo.ids(f"r{i}", k), solo.text(f"r{i}", k)) for k in range(p.n)]

    run = with_budget(make_scheduler, 20 * BLOCK_TOKENS)  # the prompts fit; their answers do not, together
    core = run.sched
    for i, (ids, p) in enumerate(zip(prompts, params, strict=True)):
        run.add(f"r{i}", ids, p)
    until_done_within_budget(run)

    assert core.stats.preemptions > 0
    for rid, expected in alone.items():
        assert [(run.ids(rid, k), run.text(rid, k)) for k in range(len(expected))] == expected, rid
        assert all(o.finish_reason == "length" for o in run.finals(rid))


def test_a_cancelled_preempted_request_leaves_nothing_behind(make_scheduler, real_engine):
    prompts = [real_engine.encode_prompt(messages=[{"role": "user", "content": p}]) for p in PROMPTS]
    run = with_budget(make_scheduler, 16 * BLOCK_TOKENS)
    core = run.sched
    cancelled: set[str] = set()
    for i, ids in enumerate(prompts):
        rid = f"r{i}"
        run.add(rid, ids, greedy(80, ignore_eos=True), is_cancelled=lambda rid=rid: rid in cancelled)
    victim = until_preempted(run).group.request.request_id
    cancelled.add(victim)
    until_done_within_budget(run)
    assert run.final(victim).finish_reason == "cancelled"
    assert all(run.final(f"r{i}").finish_reason == "length" for i in range(4) if f"r{i}" != victim)
    assert not core.scheduler.has_work() and core.scheduler.queue_depth == 0


def test_a_large_waiting_request_is_not_passed_by_later_small_ones(make_scheduler, prompt):
    """First come, first served: a request waiting for room holds back later ones that would fit, so a stream of
    small requests can never starve it."""
    run = with_budget(make_scheduler, 17 * BLOCK_TOKENS)
    run.add("a", prompt, long_run(2, 30))
    run.step()
    run.add("waiting", prompt * 6, long_run(1, 30))  # 14 blocks: more than "a" leaves, room only once it ends
    run.add("small", prompt, long_run(1, 8))
    while not run.outputs["waiting"]:
        assert not run.outputs["small"]
        run.step()
    until_done_within_budget(run)
    assert run.final("waiting").finish_reason == run.final("small").finish_reason == "length"


def test_a_preempted_stream_sends_a_heartbeat_while_it_waits(make_scheduler, real_engine):
    """Nothing to stream while preempted; after PREEMPTED_HEARTBEAT_S of silence an empty output says the request
    is alive (the gateway's inter-chunk timeout would otherwise cut it). The clock is the test's."""
    prompts = [real_engine.encode_prompt(messages=[{"role": "user", "content": p}]) for p in PROMPTS]
    run = with_budget(make_scheduler, 16 * BLOCK_TOKENS)
    core = run.sched
    for i, ids in enumerate(prompts):
        run.add(f"r{i}", ids, greedy(80, ignore_eos=True))
    victim = until_preempted(run).group.request.request_id
    sent = len(run.outputs[victim])
    core.scheduler.end_step()  # no time has passed: no heartbeat
    assert len(run.outputs[victim]) == sent
    core.scheduler.clock = lambda: time.monotonic() + PREEMPTED_HEARTBEAT_S
    core.scheduler.end_step()
    beat = run.outputs[victim][-1]
    assert len(run.outputs[victim]) == sent + 1 and beat.progress and beat.text == "" and not beat.final
    until_done_within_budget(run)
    assert run.final(victim).finish_reason == "length"


def test_a_preempted_candidate_takes_its_own_blocks_back_from_the_prefix_cache(make_scheduler, real_engine):
    """A preempted candidate's written blocks stay keyed when it gives them back, and being the most recently
    freed they are reused last: its recompute starts past its prompt, inside its own output, and the tokens are
    still the ones it has alone."""
    prompts = [real_engine.encode_prompt(messages=[{"role": "user", "content": p}]) for p in PROMPTS]
    alone = {}
    for i, ids in enumerate(prompts):
        solo = Run(make_scheduler())
        solo.add(f"r{i}", ids, greedy(80, ignore_eos=True))
        solo.until_done()
        alone[f"r{i}"] = solo.ids(f"r{i}")

    run = with_budget(make_scheduler, 20 * BLOCK_TOKENS, prefix_cache_tokens=20 * BLOCK_TOKENS)
    core = run.sched
    resumed_past_prompt = []  # per return: whether its cached start lies inside its output
    plan_step = core.scheduler.schedule

    def recording():
        plan = plan_step()
        for span in plan.spans:
            if span.seq.output_ids and span.start == span.seq.num_computed and span.start > 0 and span.sample:
                resumed_past_prompt.append(span.start > len(span.seq.prompt_ids))
        return plan

    core.scheduler.schedule = recording
    for i, ids in enumerate(prompts):
        run.add(f"r{i}", ids, greedy(80, ignore_eos=True))
    until_done_within_budget(run)

    assert core.stats.preemptions > 0 and any(resumed_past_prompt)
    assert {rid: run.ids(rid) for rid in alone} == alone
