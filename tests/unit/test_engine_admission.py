"""KV admission without reservations, and preemption by recompute, on a synchronous scheduler.

Each test sets a small KV budget on its scheduler. A request is admitted when its prompt's blocks fit (engine.core.
slots); nothing is held for tokens not yet generated, and when running rows outgrow the budget the newest is
preempted and later recomputed from its prompt and the tokens it has streamed.
"""

from __future__ import annotations

import time

import pytest

from engine.core.sequence import Sequence
from engine.core.slots import BLOCK_TOKENS, SlotTable, blocks
from engine.errors import EngineError
from engine.sampling_params import SamplingParams

from .engine_run import PROMPTS, Run, greedy


@pytest.fixture(scope="module")
def prompt(real_engine) -> list[int]:
    return real_engine.encode_prompt(messages=[{"role": "user", "content": "Tell me a long story."}])


def long_run(n: int, max_tokens: int, seed: int = 3) -> SamplingParams:
    return SamplingParams(temperature=1.0, seed=seed, n=n, max_tokens=max_tokens, ignore_eos=True)


def with_budget(core, tokens: int) -> Run:
    """The scheduler's KV pool limited to `tokens` positions."""
    scheduler = core.scheduler
    scheduler.slots = SlotTable(core.runner.cache, tokens)
    scheduler.kv_budget = scheduler.slots.kv_budget
    scheduler.stats.kv_budget = scheduler.slots.budget_blocks
    return Run(core)


def written_blocks(slots) -> int:
    """Blocks that hold K/V now: every decoding row's, and the row being prefilled, each counted once."""
    rows = list(slots.decoding) + (slots.prefilling.sequences[:1] if slots.prefilling is not None else [])
    return len({block for seq in rows for block in seq.blocks})


def until_done_within_budget(run: Run, max_steps: int = 2000) -> None:
    """Step to the end, checking after every step that the blocks held never pass the budget, that the pool's
    count is the rows' own, and at the end that every block came back."""
    slots = run.sched.scheduler.slots
    for _ in range(max_steps):
        if not run.sched.scheduler.has_work():
            assert slots.pool.used == 0 and slots.pool.available == slots.budget_blocks
            return
        run.step()
        assert written_blocks(slots) == slots.pool.used <= slots.budget_blocks
        for seq in slots.decoding:
            assert len(seq.blocks) * BLOCK_TOKENS >= seq.kv_len
    raise AssertionError("scheduler did not finish")


def until_preempted(run: Run, limit: int = 400) -> Sequence:
    """Step until a candidate is preempted; returns it (the only one)."""
    for _ in range(limit):
        run.step()
        if run.sched.scheduler.preempted:
            (seq,) = run.sched.scheduler.preempted
            return seq
    raise AssertionError(f"nothing was preempted in {limit} steps")


def steps_until_first_token(run: Run, rid: str, limit: int = 400) -> int:
    for step in range(1, limit + 1):
        run.step()
        if run.outputs[rid]:
            return step
    raise AssertionError(f"{rid} got no output in {limit} steps")


def test_a_request_over_half_the_budget_runs_to_its_end(make_scheduler, prompt):
    """A reservation of n x (prompt + max_tokens) over half the budget used to be a 400; it fits as it grows."""
    run = with_budget(make_scheduler(), 512)
    assert 2 * (len(prompt) + 200) > 512 // 2
    run.add("big", prompt, long_run(2, 200))
    until_done_within_budget(run)
    assert [o.finish_reason for o in run.finals("big")] == ["length"]
    assert len(run.ids("big", 0)) == len(run.ids("big", 1)) == 200


def test_refused_only_what_could_never_run(make_scheduler, prompt):
    run = with_budget(make_scheduler(), 8 * BLOCK_TOKENS)
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

    core = make_scheduler()
    run = with_budget(core, 20 * BLOCK_TOKENS)  # the prompts fit; their answers do not, together
    for i, (ids, p) in enumerate(zip(prompts, params, strict=True)):
        run.add(f"r{i}", ids, p)
    until_done_within_budget(run)

    assert core.stats.preemptions > 0
    for rid, expected in alone.items():
        assert [(run.ids(rid, k), run.text(rid, k)) for k in range(len(expected))] == expected, rid
        assert all(o.finish_reason == "length" for o in run.finals(rid))
    assert core.scheduler.slots.used_blocks() == 0 and not core.scheduler.preempted


def test_a_cancelled_preempted_request_leaves_nothing_behind(make_scheduler, real_engine):
    prompts = [real_engine.encode_prompt(messages=[{"role": "user", "content": p}]) for p in PROMPTS]
    core = make_scheduler()
    run = with_budget(core, 16 * BLOCK_TOKENS)
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


def test_a_small_request_goes_past_a_waiting_one_that_does_not_fit_yet(make_scheduler, prompt):
    """A request waiting for room must not hold back a later one that fits now (not strict FIFO)."""
    run = with_budget(make_scheduler(), 17 * BLOCK_TOKENS)
    run.add("a", prompt, long_run(2, 30))
    run.step()
    long_prompt = prompt * 6  # 14 blocks: more than "a" leaves, room only once it ends
    assert run.sched.scheduler.slots.available() < 14 <= 17
    run.add("waiting", long_prompt, long_run(1, 30))
    run.add("small", prompt, long_run(1, 8))
    assert steps_until_first_token(run, "small") <= 2
    assert not run.outputs["waiting"]
    until_done_within_budget(run)
    assert run.final("waiting").finish_reason == "length"  # and the one it went past still runs to the end


def test_a_preempted_stream_sends_a_heartbeat_while_it_waits(make_scheduler, real_engine):
    """Nothing to stream while preempted; after PREEMPTED_HEARTBEAT_S of silence an empty output says the request
    is alive (the gateway's inter-chunk timeout would otherwise cut it). The clock is the test's."""
    from engine.core.preemption import PREEMPTED_HEARTBEAT_S

    prompts = [real_engine.encode_prompt(messages=[{"role": "user", "content": p}]) for p in PROMPTS]
    core = make_scheduler()
    run = with_budget(core, 16 * BLOCK_TOKENS)
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


def test_a_new_request_may_start_while_a_preempted_one_waits_but_only_so_often(make_scheduler, real_engine):
    """A new prompt that fits gets its first token without waiting for someone else's long answer, but each
    preempted candidate is passed over at most BYPASS_LIMIT times."""
    from engine.core.preemption import BYPASS_LIMIT

    prompts = [real_engine.encode_prompt(messages=[{"role": "user", "content": p}]) for p in PROMPTS]
    core = make_scheduler()
    run = with_budget(core, 16 * BLOCK_TOKENS)
    for i, ids in enumerate(prompts[:3]):
        run.add(f"r{i}", ids, greedy(80, ignore_eos=True))
    waiting = until_preempted(run)
    waiting.bypassed = BYPASS_LIMIT  # its turn: nothing new starts until it is back
    run.add("held", prompts[3], greedy(4))
    for _ in range(400):
        run.step()
        if run.outputs["held"]:
            break
    # by the new request's first token, the preempted candidate whose turn it was had been taken back
    assert waiting not in core.scheduler.preempted
    until_done_within_budget(run)
    assert run.final("held").finish_reason == "length"


def test_a_preempted_candidate_takes_its_own_blocks_back_from_the_prefix_cache(make_scheduler, real_engine):
    """A preempted candidate's written blocks stay keyed when it gives them back, and being the most recently
    freed they are reused last: its recompute starts past its prompt, inside its own output, and the tokens are
    still the ones it has alone."""
    from engine.core.prefix_cache import PrefixCache

    prompts = [real_engine.encode_prompt(messages=[{"role": "user", "content": p}]) for p in PROMPTS]
    alone = {}
    for i, ids in enumerate(prompts):
        solo = Run(make_scheduler())
        solo.add(f"r{i}", ids, greedy(80, ignore_eos=True))
        solo.until_done()
        alone[f"r{i}"] = solo.ids(f"r{i}")

    core = make_scheduler()
    run = with_budget(core, 20 * BLOCK_TOKENS)
    sched = core.scheduler
    sched.prefix_cache = PrefixCache(sched.slots.pool, 20 * BLOCK_TOKENS, BLOCK_TOKENS)
    resumed_past_prompt = []  # per recompute: whether its cached start lies inside its output
    start = sched.start_recompute

    def recording(slot, available):
        before = sched.slots.prefilling
        job = start(slot, available)
        if job is not None and job is not before:
            resumed_past_prompt.append(job.prefilled > len(job.seq.prompt_ids))
        return job

    sched.start_recompute = recording
    for i, ids in enumerate(prompts):
        run.add(f"r{i}", ids, greedy(80, ignore_eos=True))
    until_done_within_budget(run)

    assert core.stats.preemptions > 0 and any(resumed_past_prompt)
    assert {rid: run.ids(rid) for rid in alone} == alone


def test_a_new_request_gets_its_first_token_before_a_preempted_candidate_comes_back(make_scheduler, real_engine,
                                                                                     prompt):
    """New prompts take the step's prefill budget before any recompute: a client waiting for its first token (the
    gateway's first-chunk timeout) goes ahead of a stream that has already started and only pauses."""
    from engine.core.slots import Recompute

    prompts = [real_engine.encode_prompt(messages=[{"role": "user", "content": p}]) for p in PROMPTS]
    core = make_scheduler(prefill_budget=len(prompt) + 8)  # room for one prompt or one recompute chunk a step
    run = with_budget(core, 16 * BLOCK_TOKENS)
    for i, ids in enumerate(prompts[:3]):
        run.add(f"r{i}", ids, greedy(80, ignore_eos=True))
    victim = until_preempted(run)
    slots = core.scheduler.slots
    for _ in range(400):  # until its blocks fit again: the next step could take it back
        need = blocks(len(victim.prompt_ids) + len(victim.output_ids))  # its tokens but the last, and the last's
        if slots.fits(need, 1, len(slots.decoding), slots.available()):
            break
        run.step()
    assert victim in core.scheduler.preempted
    run.add("fresh", prompt, greedy(4))
    run.step()
    assert run.outputs["fresh"]  # its first token came this very step
    job = core.scheduler.slots.prefilling
    assert victim in core.scheduler.preempted or (isinstance(job, Recompute) and job.seq is victim)
    until_done_within_budget(run)
    assert run.final("fresh").finish_reason == "length" and run.final(victim.group.request.request_id)
