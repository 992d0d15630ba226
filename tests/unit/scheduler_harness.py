"""A scheduler without a model (as vLLM's tests/v1/core tests its scheduler): a KV cache of a few bytes a position
stands in for the model's, and each step's "forward" is the bookkeeping the engine core does around one (the
computed counts moved on, a token recorded for every sampling row, finished candidates retired and closed).
"""

from __future__ import annotations

import torch

from engine.core.kv_manager import BLOCK_TOKENS
from engine.core.scheduler import Scheduler
from engine.core.sequence import Sequence
from engine.core.step_plan import StepPlan
from engine.model.kv_cache import KVCache
from engine.request import EngineRequest, RequestOutput
from engine.sampling_params import SamplingParams


class _Runner:
    """What the scheduler reads of a model runner: its KV cache and its adapters."""

    def __init__(self, slots: int, max_len: int, blocks: int) -> None:
        self.cache = KVCache(layers=1, slots=slots, kv_heads=1, max_len=max_len, head_dim=2, dtype=torch.float32,
                             device="cpu", num_blocks=blocks + 1)
        self.adapters: dict = {"a1": object(), "a2": object()}


class _Counts:
    def release(self, seq) -> None:
        pass


class _Tokenizer:
    def decode(self, ids, skip_special_tokens=True) -> str:
        return "".join(f"<{i}>" for i in ids)


def scheduler(slots: int = 8, max_len: int = 512, blocks: int = 64, budget: int = 64, prefix_cache: bool = False,
              partial: int = 1, policy: str = "fcfs") -> Scheduler:
    return Scheduler(_Runner(slots, max_len, blocks), _Counts(), _Tokenizer(), max_num_batched_tokens=budget,
                     kv_budget_tokens=blocks * BLOCK_TOKENS, prefix_cache_tokens=blocks * BLOCK_TOKENS * prefix_cache,
                     max_partial_prefills=partial, check_invariants=True, scheduling_policy=policy)


def prompt_of(name: str, length: int) -> list[int]:
    return [1000 + (sum(map(ord, name)) * 7 + i) % 500 for i in range(length)]


def add(sched: Scheduler, rid: str, prompt: int | list[int], max_tokens: int = 100, n: int = 1,
        best_of: int | None = None, adapter: str | None = None, cancelled=None, priority: int = 0,
        tenant: str | None = None, weight: float = 1.0) -> list[RequestOutput]:
    outputs: list[RequestOutput] = []
    tokens = prompt_of(rid, prompt) if isinstance(prompt, int) else prompt
    params = SamplingParams(temperature=0.0 if n == 1 and not best_of else 1.0, max_tokens=max_tokens, n=n,
                            best_of=best_of, ignore_eos=True, lora_adapter=adapter)
    sched.add(EngineRequest(rid, tokens, params, outputs.append, is_cancelled=cancelled, priority=priority,
                            tenant=tenant, tenant_weight=weight))
    return outputs


def token_for(seq: Sequence, position: int) -> int:
    """A deterministic 'sample': the same for a candidate's token at `position` of its output whatever the batch or
    preemptions."""
    return 10 + (seq.index * 31 + position * 7 + len(seq.prompt_ids)) % 90


def check_plan(sched: Scheduler, plan: StepPlan) -> None:
    """What the runner relies on: decode rows in batch rows 0..B-1 and the spans after them, each sequence once,
    each span continuing its sequence's computed tokens, the step within its token budget, and every row's block
    table in the cache covering the positions it writes."""
    seqs = plan.decode + [span.seq for span in plan.spans]
    assert len({id(seq) for seq in seqs}) == len(seqs)
    assert [seq.slot for seq in plan.decode] == list(range(len(plan.decode)))
    assert [span.slot for span in plan.spans] == list(range(len(plan.decode), len(seqs)))
    assert len(plan.decode) + sum(len(span.tokens) for span in plan.spans) <= sched.token_budget
    for seq in plan.decode:
        assert seq.num_computed == seq.num_tokens - 1 and seq.output_ids
    for span in plan.spans:
        assert span.start == span.seq.num_computed and span.tokens == span.seq.tokens(span.start, span.end)
        assert span.sample == (span.end == span.seq.num_tokens)
    for seq in seqs:
        end = seq.num_tokens if seq in plan.decode else next(s.end for s in plan.spans if s.seq is seq)
        assert len(seq.blocks) * BLOCK_TOKENS >= end
        assert list(sched.kv.cache.rows[seq.slot, : len(seq.blocks)]) == seq.blocks


def run(sched: Scheduler, plan: StepPlan) -> list[Sequence]:
    """What the engine core does around the forward. Returns the rows that sampled."""
    check_plan(sched, plan)
    rows, _ = sched.complete(plan.decode, plan.spans)
    sampled = plan.decode + rows
    for seq in sampled:  # a token is sampled only once every token before it is computed
        assert seq.num_computed == seq.num_tokens
    for seq in sampled:
        seq.record_token(token_for(seq, len(seq.output_ids)), 0.0)
        if len(seq.output_ids) >= seq.params.max_tokens:
            seq.finish_reason = "length"
    for span in plan.spans:
        if span.forks and not span.seq.finished:
            sched.cache_prompt(span.seq.group)
    for seq in sampled:
        if seq.finished:
            sched.cache_finished(seq)
            sched.retire(seq)
            group = seq.group
            if all(s.finished for s in group.sequences) and not group.sent_final:
                group.emit(RequestOutput("", 0, "", finish_reason="length", final=True))
    sched.end_step()
    return sampled


def step(sched: Scheduler) -> StepPlan:
    plan = sched.schedule()
    run(sched, plan)
    return plan


def rid(seqs) -> list[str]:
    return [seq.group.request.request_id for seq in seqs]


def until_idle(sched: Scheduler, limit: int = 5000) -> int:
    """Steps until every request has ended (the invariants are checked after each); returns how many."""
    for count in range(limit):
        if not sched.has_work():
            return count
        step(sched)
    raise AssertionError(f"requests still in flight after {limit} steps: {rid(sched.running)} {rid(sched.waiting)}")


def assert_pool_whole(sched: Scheduler) -> None:
    pool = sched.kv.pool
    assert pool.used == 0 and pool.available == pool.total
    assert not sched.requests and not sched.running and not len(sched.waiting)
