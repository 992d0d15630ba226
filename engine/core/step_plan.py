"""What one engine step runs, decided before it runs (as vLLM v1's `SchedulerOutput`): the scheduler's answer
(engine.core.scheduler), which the runner executes in one forward and the engine core completes.

Every scheduled sequence computes its next tokens from its computed count: a decode row its one last token, a
prompt (or a preempted candidate coming back) a span of its tokens. The decode rows hold batch rows 0..B-1; the
spans follow in rows B.., each a runner `Span` that also names its sequence. A span samples when it reaches the
end of its sequence's tokens: a new prompt's first token, or a returning candidate's next one. The scheduler
builds a plan with a `StepBuilder` as it goes.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from engine.core.kv_manager import BLOCK_TOKENS, KVManager
from engine.core.sequence import Sequence
from engine.runner.model_runner import Span


@dataclass(kw_only=True)
class PlannedSpan(Span):
    seq: Sequence  # whose tokens these are

    @property
    def end(self) -> int:
        return self.start + len(self.tokens)

    @property
    def forks(self) -> bool:
        """It ends a new request's prompt: its first token is sampled once for each n/best_of candidate."""
        return self.sample and not self.seq.group.forked


@dataclass
class StepPlan:
    decode: list[Sequence] = field(default_factory=list)  # rows 0..B-1, each feeding its last token
    spans: list[PlannedSpan] = field(default_factory=list)  # rows B.., in order
    preempted: int = 0  # candidates that gave their blocks back so that this step's rows fit

    @property
    def empty(self) -> bool:
        return not (self.decode or self.spans)


class StepBuilder:
    """One step's scheduling as it goes: the token budget left, and which sequence computes up to which position."""

    def __init__(self, budget: int) -> None:
        self.budget = budget
        self.partial = 0  # prompt spans this step that stop short of their end
        self.growth = 0  # rows whose next step starts a new block (admission keeps room for them)
        self.scheduled: list[tuple[Sequence, int]] = []

    def add(self, seq: Sequence, end: int) -> None:
        """`seq` computes its tokens up to position `end` this step (its KV room already allocated)."""
        self.budget -= end - seq.num_computed
        self.scheduled.append((seq, end))
        if end < seq.num_tokens:
            self.partial += 1
        elif end % BLOCK_TOKENS == 0:
            self.growth += 1 if seq.group.forked else seq.group.params.width

    def plan(self, kv: KVManager) -> StepPlan:
        """Decode rows in batch rows 0..B-1, then the spans; each sequence's block table seated in its row."""
        plan = StepPlan()
        spans: list[tuple[Sequence, int]] = []
        for seq, end in self.scheduled:
            if seq.group.forked and end == seq.num_tokens == seq.num_computed + 1:
                plan.decode.append(seq)
            else:
                spans.append((seq, end))
        for row, seq in enumerate(plan.decode):
            kv.seat(seq, row)
        for row, (seq, end) in enumerate(spans, start=len(plan.decode)):
            kv.seat(seq, row)
            start, request = seq.num_computed, seq.group.request
            embeds = None
            if request.prompt_embeds is not None and start < len(seq.prompt_ids):
                embeds = request.prompt_embeds[start:end]
            plan.spans.append(PlannedSpan(slot=row, tokens=seq.tokens(start, end), start=start,
                                          sample=end == seq.num_tokens, adapter=seq.params.lora_adapter,
                                          embeds=embeds, seq=seq))
        return plan
