"""What one engine step runs, decided before it runs (as vLLM v1's `SchedulerOutput`): the scheduler's answer
(engine.core.scheduler), which the runner executes in one forward and the engine core completes.

Every scheduled sequence computes its next tokens from its computed count: a decode row its one last token, a
prompt (or a preempted candidate coming back) a span of its tokens. The decode rows hold batch rows 0..B-1; the
spans follow in rows B.., each a runner `Span` that also names its sequence. A span samples when it reaches the
end of its sequence's tokens: a new prompt's first token, or a returning candidate's next one.
"""

from __future__ import annotations

from dataclasses import dataclass, field

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
