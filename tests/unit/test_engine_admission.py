"""KV admission never parks a small request behind one huge reservation (issue 20 item 5), synchronous scheduler.

Each test sets a small KV budget on its scheduler; a request reserves n x (prompt + max_tokens) positions.
"""

from __future__ import annotations

import pytest

from engine.errors import EngineError
from engine.sampling_params import SamplingParams

from .engine_run import Run


@pytest.fixture(scope="module")
def prompt(real_engine) -> list[int]:
    return real_engine.encode_prompt(messages=[{"role": "user", "content": "Tell me a long story."}])


def long_run(n: int, max_tokens: int) -> SamplingParams:
    return SamplingParams(temperature=1.0, seed=3, n=n, max_tokens=max_tokens, ignore_eos=True)


def with_budget(core, tokens: int) -> Run:
    scheduler = core.scheduler
    scheduler.kv_budget = scheduler.slots.kv_budget = tokens
    return Run(core)


def steps_until_first_token(run: Run, rid: str, limit: int = 400) -> int:
    for step in range(1, limit + 1):
        run.step()
        if run.outputs[rid]:
            return step
    raise AssertionError(f"{rid} got no output in {limit} steps")


def test_one_request_may_reserve_at_most_half_the_kv_budget(make_scheduler, prompt):
    """The issue's case: n=33 x 1950 tokens reserved 64.5k of 65.5k, and every chat request waited until its
    first-chunk timeout. A request over its share is a 400 naming what to lower, before it runs."""
    run = with_budget(make_scheduler(), 512)
    share = 512 // 2
    assert 2 * (len(prompt) + 200) > share
    with pytest.raises(EngineError) as info:
        run.add("huge", prompt, long_run(2, 200))
    assert (info.value.code, info.value.param) == ("invalid_request", "n")
    assert "share" in info.value.message
    run.add("half", prompt, long_run(2, share // 2 - len(prompt)))  # exactly at the share: accepted
    assert run.groups["half"].kv_need == share
    run.until_done()
    assert run.final("half").finish_reason == "length"


def test_a_small_request_goes_past_a_waiting_one_that_does_not_fit_yet(make_scheduler, prompt):
    """A request waiting for room must not hold back a later one that fits now (not strict FIFO)."""
    run = with_budget(make_scheduler(), 512)  # share: 256
    run.add("a", prompt, long_run(2, 30))  # 2 x (prompt + 30) = 132 reserved for 30 steps
    run.add("b", prompt, long_run(2, 30))  # 132 more
    run.step()
    run.add("waiting", prompt, long_run(2, 128 - len(prompt)))  # 256: fits only once "a" or "b" ends
    assert run.sched.scheduler.slots.reserved + run.groups["waiting"].kv_need > 512
    run.add("small", prompt, long_run(1, 8))  # prompt + 8: fits now
    assert steps_until_first_token(run, "small") <= 2
    run.until_done()
    assert run.final("waiting").finish_reason == "length"  # and the one it went past still runs to the end
