"""The scheduler's step plans, without a model (as vLLM's tests/v1/core/test_scheduler.py tests its scheduler): a
KV cache of a few bytes a position stands in for the model's, and each step's "forward" is the bookkeeping the
engine core does after one (the decode rows' K/V counted, the spans completed, a token recorded for every row).
"""

from __future__ import annotations

import torch

from engine.core.scheduler import Scheduler
from engine.core.slots import BLOCK_TOKENS, Recompute
from engine.core.step_plan import StepPlan
from engine.model.kv_cache import KVCache
from engine.request import EngineRequest, RequestOutput
from engine.sampling_params import SamplingParams


class _Runner:
    """What the scheduler reads of a model runner: its KV cache and its adapters."""

    def __init__(self, slots: int, max_len: int, blocks: int) -> None:
        self.cache = KVCache(layers=1, slots=slots, kv_heads=1, max_len=max_len, head_dim=2, dtype=torch.float32,
                             device="cpu", num_blocks=blocks + 1)
        self.adapters: dict = {}


class _Counts:
    def release(self, seq) -> None:
        pass


class _Tokenizer:
    def decode(self, ids, skip_special_tokens=True) -> str:
        return "".join(f"<{i}>" for i in ids)


def scheduler(slots: int = 8, max_len: int = 512, blocks: int = 64, budget: int = 64,
              prefix_cache: bool = False) -> Scheduler:
    return Scheduler(_Runner(slots, max_len, blocks), _Counts(), _Tokenizer(), prefill_budget=budget,
                     kv_budget_tokens=blocks * BLOCK_TOKENS, prefix_cache_tokens=blocks * BLOCK_TOKENS * prefix_cache)


def add(sched: Scheduler, rid: str, prompt_len: int, max_tokens: int = 100, n: int = 1) -> list[RequestOutput]:
    outputs: list[RequestOutput] = []
    prompt = [1000 + (hash(rid) + i) % 500 for i in range(prompt_len)]
    params = SamplingParams(temperature=0.0 if n == 1 else 1.0, max_tokens=max_tokens, n=n, ignore_eos=True)
    sched.add(EngineRequest(rid, prompt, params, outputs.append))
    return outputs


def run(sched: Scheduler, plan: StepPlan, token: int = 7) -> None:
    """What the engine core does around the forward, with `token` as every row's sample."""
    for seq in plan.decode:
        seq.kv_len += 1
    new_rows = sched.complete(plan, plan.prefill)
    for seq in plan.decode + new_rows:
        seq.record_token(token, 0.0)
    for seq in plan.decode + new_rows:
        if len(seq.output_ids) >= seq.params.max_tokens:
            sched.retire(seq)
    sched.end_step()


def rid(plan_rows) -> list[str]:
    return [seq.group.request.request_id for seq in plan_rows]


def check_rows(sched: Scheduler) -> None:
    """The slot invariant: decode rows in slots 0..B-1, the prompt in progress right after them."""
    assert [seq.slot for seq in sched.slots.decoding] == list(range(len(sched.slots.decoding)))
    job = sched.slots.prefilling
    if job is not None:
        assert job.sequences[0].slot == len(sched.slots.decoding)


def test_short_prompts_prefill_in_one_plan_and_decode_from_the_next():
    sched = scheduler()
    add(sched, "a", 20)
    add(sched, "b", 30)
    plan = sched.schedule()
    assert plan.decode == []
    assert [(s.job.request.request_id, s.start, s.end, s.completes, s.samples) for s in plan.prefill] == [
        ("a", 0, 20, True, True), ("b", 0, 30, True, True)]
    assert [s.seq.slot for s in plan.prefill] == [0, 1]
    run(sched, plan)
    check_rows(sched)
    plan = sched.schedule()
    assert rid(plan.decode) == ["a", "b"] and plan.prefill == []
    assert [s.kv_len for s in plan.decode] == [20, 30]  # each feeds its first token at the end of its prompt


def test_a_long_prompt_is_chunked_while_the_running_rows_decode_in_the_same_plan():
    sched = scheduler(budget=64)
    add(sched, "short", 10)
    run(sched, sched.schedule())
    add(sched, "long", 150)
    spans = []
    for _ in range(3):
        plan = sched.schedule()
        assert rid(plan.decode) == ["short"]  # never held back by the prefill
        (span,) = plan.prefill
        spans.append((span.start, span.end, span.completes, span.seq.slot))
        run(sched, plan)
        check_rows(sched)
    assert spans == [(0, 64, False, 1), (64, 128, False, 1), (128, 150, True, 1)]
    assert rid(sched.schedule().decode) == ["short", "long"]


def test_the_budget_left_by_a_finished_prompt_starts_the_next_in_the_row_after_its_candidates():
    sched = scheduler(budget=64)
    add(sched, "pair", 100, n=2)  # longer than the budget: the chunked path, one prompt after the other
    add(sched, "next", 80)
    run(sched, sched.schedule())  # pair 0..64
    plan = sched.schedule()
    assert [(s.job.request.request_id, s.start, s.end, s.seq.slot) for s in plan.prefill] == [
        ("pair", 64, 100, 0), ("next", 0, 28, 2)]  # slot 1 is the pair's second candidate's
    run(sched, plan)
    check_rows(sched)
    assert rid(sched.slots.decoding) == ["pair", "pair"]
    assert sched.slots.prefilling is not None and sched.slots.prefilling.sequences[0].slot == 2


def test_when_blocks_run_out_the_newest_is_preempted_and_recomputed_after_new_prompts():
    sched = scheduler(blocks=8, budget=256, prefix_cache=True)  # 128 positions; each request needs 100 (7 blocks)
    add(sched, "old", 40, max_tokens=60)
    add(sched, "new", 40, max_tokens=60)
    run(sched, sched.schedule())
    for _ in range(60):
        plan = sched.schedule()
        if plan.preempted:
            break
        run(sched, plan)
    assert plan.preempted == 1
    assert rid(plan.decode) == ["old"] and rid(sched.preempted) == ["new"]
    old = plan.decode[0]
    while len(old.output_ids) < 59:  # the old one runs alone (the new one waits preempted)
        run(sched, plan)
        check_rows(sched)
        assert sched.slots.pool.used <= sched.slots.budget_blocks
        plan = sched.schedule()
        assert rid(plan.decode) == ["old"] and plan.prefill == []
    add(sched, "third", 20, max_tokens=1)
    run(sched, plan)  # the old one's last token: it retires and gives its blocks back
    plan = sched.schedule()
    names = [(s.job.group if isinstance(s.job, Recompute) else s.job).request.request_id for s in plan.prefill]
    assert names == ["third", "new"]  # the new prompt first, then the recompute with the budget it left
    recompute = plan.prefill[1]
    assert isinstance(recompute.job, Recompute) and recompute.completes and not recompute.samples
    assert recompute.start % BLOCK_TOKENS == 0 and recompute.start > 0  # its own blocks came back from the cache
    assert [s.seq.slot for s in plan.prefill] == [0, 1]
    run(sched, plan)
    check_rows(sched)
    assert rid(sched.slots.decoding) == ["new"]  # the third one finished on its first token


def test_a_request_whose_span_failed_leaves_no_hole_in_the_rows():
    sched = scheduler()
    add(sched, "a", 20)
    add(sched, "b", 20)
    add(sched, "c", 20)
    plan = sched.schedule()
    assert [s.seq.slot for s in plan.prefill] == [0, 1, 2]
    failed = plan.prefill[1].job
    sched.abort(failed, "error")
    new_rows = sched.complete(plan, [plan.prefill[0], plan.prefill[2]])
    assert rid(new_rows) == ["a", "c"]
    check_rows(sched)
    assert sched.slots.pool.used == 2 * 2  # "b" gave its blocks back; each of the others holds 2


def test_preempted_candidates_come_back_together_in_one_plan_when_room_frees():
    sched = scheduler(blocks=10, budget=512)  # 160 positions: the long request alone ends up holding all of them
    add(sched, "long", 40, max_tokens=100)
    add(sched, "b", 20, max_tokens=70)
    add(sched, "c", 20, max_tokens=70)
    plan = sched.schedule()
    while not plan.prefill or not isinstance(plan.prefill[0].job, Recompute):
        assert not plan.empty, "nothing came back"
        run(sched, plan)
        check_rows(sched)
        plan = sched.schedule()
    assert sched.stats.preemptions == 2
    assert [s.job.group.request.request_id for s in plan.prefill] == ["b", "c"]  # oldest first, one forward
    assert all(isinstance(s.job, Recompute) and s.completes for s in plan.prefill)
    assert [s.seq.slot for s in plan.prefill] == [0, 1]
    run(sched, plan)
    check_rows(sched)
    assert rid(sched.slots.decoding) == ["b", "c"]
