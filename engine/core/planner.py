"""The step plan (engine.core.step_plan): which rows decode and which prompt spans prefill in the next forward.

`schedule()` first makes room for the decode rows' next positions (preempting the newest when the blocks run out,
engine.core.preemption), then fills the step's prefill budget: the prompt in progress, or a batch of whole short
prompts, or the next prompts chunk by chunk; then, with what new prompts left, preempted candidates being
recomputed. New prompts come first because a first token is what a client waits on. Each job is seated in the
row after the last one planned, and takes the blocks its span writes. `complete()` runs after the forward: the
spans' K/V count, finished prompts are placed as decode rows (their candidates forked) and recomputed candidates
resume; a request whose own forward failed is gone and the rows after it move down.

The scheduler's part that plans; engine.core.scheduler mixes it in. It never runs a forward.
"""

from __future__ import annotations

import collections

from engine.core.sequence import Sequence, SequenceGroup
from engine.core.slots import Prefilling, Recompute, SlotTable, job_rows, job_tokens, owner, still_takes
from engine.core.stats import EngineStats
from engine.core.step_plan import PrefillSpan, StepPlan


class Planner:
    # the scheduler's state this part reads and changes
    slots: SlotTable
    waiting: collections.deque[SequenceGroup]
    preempted: list[Sequence]
    prefill_budget: int
    stats: EngineStats
    _slot: int  # while planning: the row the next job is seated in
    _reserved: int  # while planning: blocks the jobs completing this step still take (still_takes)

    # implemented by the scheduler and engine.core.preemption, which come before this part in its bases
    def reap_cancelled(self) -> None:
        raise NotImplementedError

    def make_room(self) -> None:
        raise NotImplementedError

    def take_short_prompts(self, budget: int) -> list[SequenceGroup]:
        raise NotImplementedError

    def requeue(self, groups: list[SequenceGroup]) -> None:
        raise NotImplementedError

    def start_prefill(self, slot: int, available: int) -> SequenceGroup | None:
        raise NotImplementedError

    def start_recompute(self, slot: int, available: int) -> Recompute | None:
        raise NotImplementedError

    def new_parent(self, group: SequenceGroup) -> Sequence:
        raise NotImplementedError

    def load_cached_prefix(self, group: SequenceGroup) -> None:
        raise NotImplementedError

    def place(self, group: SequenceGroup) -> list[Sequence]:
        raise NotImplementedError

    def schedule(self) -> StepPlan:
        self.reap_cancelled()
        preemptions = self.stats.preemptions
        self.make_room()
        plan = StepPlan(decode=list(self.slots.decoding))
        self._slot, self._reserved = len(plan.decode), 0
        budget = self._plan_prompts(plan, self.prefill_budget)
        self._plan_recompute(plan, budget)
        plan.preempted = self.stats.preemptions - preemptions
        return plan

    # -- planning ------------------------------------------------------------------------------

    def _available(self) -> int:
        """Blocks left for another job: the pool's, less the prefill in progress and what the jobs completing this
        step still take (their first decode position, their n/best_of copies)."""
        return self.slots.available() - self._reserved

    def _plan_span(self, plan: StepPlan, job: Prefilling, budget: int) -> int:
        """The job's next span within `budget` (its row takes the blocks the span writes). Returns the budget
        left."""
        start = job.prefilled
        end = min(start + budget, len(job_tokens(job)))
        prompt = len(job.sequences[0].prompt_ids)
        if owner(job).request.prompt_embeds is not None and start < prompt:
            end = min(end, prompt)  # an image request's embeddings span its prompt only
        self.slots.grow(job.sequences[0], end)
        span = PrefillSpan(job, start, end)
        plan.prefill.append(span)
        if span.completes:
            self.slots.prefilling = None
            self._slot += job_rows(job)
            self._reserved += still_takes(job)  # its first decode position, its candidates' copies
        return budget - (end - start)

    def _plan_prompts(self, plan: StepPlan, budget: int) -> int:
        """New prompts within the budget: a batch of whole short ones, or the prompt in progress and then the next
        ones, chunk by chunk. Returns the budget left."""
        if self.slots.prefilling is None:
            batch = self.take_short_prompts(budget)
            if len(batch) > 1:
                for group in batch:
                    self.slots.seat(self.new_parent(group), self._slot)
                    self.load_cached_prefix(group)  # a cached prefix: only the rest of the prompt runs
                    budget = self._plan_span(plan, group, budget)
                return budget
            self.requeue(batch)  # a single prompt takes the chunked path below
        while budget > 0 and (job := self.start_prefill(self._slot, self._available())) is not None:
            budget = self._plan_span(plan, job, budget)
        return budget

    def _plan_recompute(self, plan: StepPlan, budget: int) -> None:
        """Preempted candidates, oldest first, within what new prompts left of the budget."""
        while budget > 0 and (job := self.start_recompute(self._slot, self._available())) is not None:
            budget = self._plan_span(plan, job, budget)

    # -- after the forward -----------------------------------------------------------------------

    def complete(self, plan: StepPlan, spans: list[PrefillSpan]) -> list[Sequence]:
        """The spans whose forward ran (`spans`, in plan order) hold their K/V: a completed prompt's candidates
        become decode rows, a recomputed candidate resumes. Each is seated after the decode rows, so that a
        failed request's row leaves no hole. Returns the new rows that sample a first token, in plan order."""
        rows: list[Sequence] = []
        for span in spans:
            job, seq = span.job, span.seq
            seq.kv_len = span.end
            job.prefilled = span.end
            if not span.completes:
                continue
            if isinstance(job, Recompute):
                self.slots.resume(job)  # seated after the decode rows
            else:
                self.slots.seat(seq, len(self.slots.decoding))
                rows += self.place(job)
        if self.slots.prefilling is not None and self.slots.prefilling.sequences:
            self.slots.seat(self.slots.prefilling.sequences[0], len(self.slots.decoding))
        return rows
