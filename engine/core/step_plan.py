"""What one engine step runs, decided before it runs (as vLLM v1's `SchedulerOutput`): the scheduler's answer
(engine.core.planner), which the runner executes in one forward and the engine core completes.

The decode rows hold slots 0..B-1 and each feeds its last token. The prefill spans follow in slot order: a span
prefills part of a new request's prompt or of a preempted candidate's tokens, into the row its job holds. Every
span but the last completes its job; the last may leave the job half-prefilled for the next step.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from engine.core.sequence import Sequence
from engine.core.slots import Prefilling, Recompute, job_tokens, owner


@dataclass
class PrefillSpan:
    job: Prefilling  # a new request (its parent candidate prefills) or a preempted candidate's recompute
    start: int  # the position of the span's first token
    end: int  # one past its last

    @property
    def seq(self) -> Sequence:
        """The row that holds the job's K/V."""
        return self.job.sequences[0]

    @property
    def tokens(self) -> list[int]:
        return job_tokens(self.job)[self.start : self.end]

    @property
    def completes(self) -> bool:
        """It ends its job: a new request samples its first token from the span's last position, a recomputed
        candidate is a decode row again (nothing is sampled: its next token is the one it already streamed)."""
        return self.end == len(job_tokens(self.job))

    @property
    def samples(self) -> bool:
        return self.completes and not isinstance(self.job, Recompute)

    @property
    def adapter(self) -> str | None:
        return owner(self.job).params.lora_adapter

    @property
    def embeds(self) -> torch.Tensor | None:
        """An image request's input embeddings for the span's positions in its prompt (None: token embeddings)."""
        embeds = owner(self.job).request.prompt_embeds
        if embeds is None:
            return None
        prompt = len(self.seq.prompt_ids)
        if self.start >= prompt:  # a recompute's streamed tokens past the prompt
            return None
        return embeds[self.start : min(self.end, prompt)]


@dataclass
class StepPlan:
    decode: list[Sequence] = field(default_factory=list)  # rows 0..B-1, in slot order
    prefill: list[PrefillSpan] = field(default_factory=list)  # in slot order after the decode rows
    preempted: int = 0  # candidates that gave their blocks back so that this step's rows fit

    @property
    def empty(self) -> bool:
        return not (self.decode or self.prefill)
