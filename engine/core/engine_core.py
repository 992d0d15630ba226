"""One engine step, as plan -> run -> sample -> update: the scheduler plans the step (engine.core.scheduler: which
rows decode, which spans of which prompts run, who was preempted to make room), the runner runs it in one forward,
the sampler samples the decode rows and the spans that end their tokens, the output stage turns tokens into outputs
(with the one stop decision), and the scheduler counts what was computed, forks new prompts' candidates and
retires finished ones.

A request prefilled this step samples its first token from the prefill's logits and decodes from the next step
on; its n/best_of candidates are forked before any of them is sampled, each sampling from the prompt's logits.

Failures are kept to the request they belong to: a row's or a span's forward (e.g. its adapter), a row's
sampling step or its output handling fails that request with `inference_error` and the batch goes on (a failed
step's forward is retried one row and one span at a time). Only a fault of the shared device state is fatal: it
propagates, and the engine loop fails everything.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Any

import torch

from engine.core.output_processor import OutputStage, Postprocess
from engine.core.scheduler import Scheduler
from engine.core.sequence import Sequence, SequenceGroup
from engine.core.step_plan import PlannedSpan, StepPlan
from engine.core.step_timing import StepTiming
from engine.errors import EngineError, is_device_fault, request_error
from engine.runner.model_runner import ModelRunner
from engine.sampling.sampler import Sampler
from engine.staging import stage

log = logging.getLogger(__name__)

Failures = dict[int, tuple[SequenceGroup, EngineError]]  # id(group) -> (group, its error)


class EngineCore:
    def __init__(self, runner: ModelRunner, sampler: Sampler, tokenizer, max_num_batched_tokens: int = 1024,
                 kv_budget_tokens: int | None = None, prefix_cache_tokens: int = 0,
                 postprocess: Postprocess | None = None, reasoning: bool = False,
                 publish_kv_events: Callable[[list[dict[str, Any]]], None] | None = None,
                 max_partial_prefills: int = 1, check_invariants: bool = False,
                 scheduling_policy: str = "fcfs") -> None:
        """`postprocess`: hook(seq) -> extra closing fields (tool calls, strict-grammar checks);
        `publish_kv_events`: takes each step's KV events (engine.core.kv_events), when a router wants them;
        the rest is the scheduler's (engine.core.scheduler)."""
        self.runner = runner
        self.sampler = sampler
        self.scheduler = Scheduler(runner, sampler.counts, tokenizer, max_num_batched_tokens, kv_budget_tokens,
                                   prefix_cache_tokens, reasoning, publish_kv_events, max_partial_prefills,
                                   check_invariants, scheduling_policy)
        self.stats = self.scheduler.stats
        self.outputs = OutputStage(tokenizer, sampler.stop_token_set, self.stats, postprocess)
        self.timing = StepTiming()  # where a decode step's time goes (bench/engine.py prints it)

    def step(self) -> None:
        self.timing.start()
        plan = self.scheduler.schedule()
        self.timing.lap("schedule")
        if plan.spans:
            self.timing.prefilled()
        if not plan.empty:
            self._run(plan)
        self.scheduler.end_step()
        self.timing.lap("schedule")
        self.timing.end(len(plan.decode))

    def _run(self, plan: StepPlan) -> None:
        """The plan's forward, then the K/V it wrote counted, the new rows placed and every row sampled."""
        logits, decoded, spans, failures = self._forward(plan)
        self.timing.lap("forward")
        self.scheduler.fail(failures)
        forking = [span.seq.group for span in spans if span.forks]  # before complete() forks them
        new_rows, widths = self.scheduler.complete(decoded, spans)
        if len(new_rows) > len(widths):  # n/best_of: each candidate samples from its prompt's logits
            # given its output size, repeat_interleave needs no host sync to size the result
            widths_t = stage([1] * len(decoded) + widths, torch.long, logits.device)
            logits = logits.repeat_interleave(widths_t, dim=0, output_size=len(decoded) + len(new_rows))
        if decoded or new_rows:
            self._sample_and_advance(logits, decoded + new_rows)
        self._cache_prompts(forking)

    # -- the forward ---------------------------------------------------------------------------

    def _forward(self, plan: StepPlan) -> tuple[torch.Tensor, list[Sequence], list[PlannedSpan], Failures]:
        """The plan in one forward. Returns its logits (a row for each decode row, then for each span that
        samples), the decode rows and the spans that ran, and the requests that failed."""
        rows = plan.decode
        tokens, positions = [s.output_ids[-1] for s in rows], [s.num_computed for s in rows]
        adapters = [s.params.lora_adapter for s in rows]
        self.timing.lap("stage")
        try:
            return self.runner.step(tokens, positions, adapters, list(plan.spans)), rows, plan.spans, {}
        except Exception as exc:
            if is_device_fault(exc):
                raise
            log.exception("a step's forward failed; running its rows and spans one by one")
        return self._forward_alone(plan)

    def _forward_alone(self, plan: StepPlan) -> tuple[torch.Tensor, list[Sequence], list[PlannedSpan], Failures]:
        """After a failed step: one forward per decode row (a one-token prefill at its position writes the same
        K/V) and per span, so that only the requests whose own forward fails (e.g. their adapter) fail, with
        every row and span of theirs."""
        failures: Failures = {}
        decoded: list[tuple[Sequence, torch.Tensor]] = []
        for seq in plan.decode:
            try:
                decoded.append((seq, self.runner.prefill(seq.slot, seq.output_ids[-1:], seq.num_computed,
                                                         adapter=seq.params.lora_adapter)))
            except Exception as exc:
                failures.setdefault(id(seq.group), (seq.group, request_error(exc, "decode")))
        spans: list[tuple[PlannedSpan, torch.Tensor | None]] = []
        for span in plan.spans:
            group = span.seq.group
            fill = self.runner.prefill if span.sample else self.runner.prefill_part
            try:
                spans.append((span, fill(span.slot, span.tokens, span.start, adapter=span.adapter,
                                         embeds=span.embeds)))
            except Exception as exc:
                log.exception("prefill failed for %s", group.request.request_id)
                failures.setdefault(id(group), (group, request_error(exc, "prefill")))
        decoded = [(seq, row) for seq, row in decoded if id(seq.group) not in failures]
        spans = [(span, row) for span, row in spans if id(span.seq.group) not in failures]
        rows = [row for _, row in decoded] + [row for _, row in spans if row is not None]
        logits = torch.stack(rows) if rows else torch.empty(0, self.runner.vocab_size)
        return logits, [seq for seq, _ in decoded], [span for span, _ in spans], failures

    def _cache_prompts(self, groups: list[SequenceGroup]) -> None:
        """Key each new prompt's blocks in the prefix cache once its first token is out (hashing a long prompt's
        blocks is not on the path to that token). A parent that already finished keyed prompt and output on
        retiring (stop or length), or is gone."""
        for group in groups:
            if not group.sequences[0].finished and not group.sent_final:
                self.scheduler.cache_prompt(group)

    # -- sample, process outputs, update -------------------------------------------------------

    def _sample_and_advance(self, logits: torch.Tensor, rows: list[Sequence]) -> None:
        masks = {i: s.grammar.apply_mask for i, s in enumerate(rows) if s.grammar is not None}
        try:
            out = self.sampler.sample(logits, rows, masks)
        except Exception as exc:
            if is_device_fault(exc):
                raise
            log.exception("sampling failed")
            self.scheduler.fail({id(s.group): (s.group, request_error(exc, "sampling")) for s in rows})
            return
        self.timing.lap("sample")
        failures: Failures = {}
        for i, error in out.row_errors.items():
            failures.setdefault(id(rows[i].group), (rows[i].group, request_error(error, "sampling")))
        self._observe_tokens(rows)
        for i, seq in enumerate(rows):
            if id(seq.group) in failures:
                continue
            try:
                self.outputs.advance(seq, out.tokens[i], out.logprobs[i], out.top[i] if out.top else None)
            except Exception as exc:
                failures[id(seq.group)] = (seq.group, request_error(exc, "output handling"))
                log.exception("output handling failed for %s", seq.group.request.request_id)
        self.timing.lap("outputs")
        self._update(rows, failures)
        self.timing.lap("emit")

    def _update(self, rows: list[Sequence], failures: Failures) -> None:
        """Retire the finished rows and close their requests (releasing the done ones), fail the failed ones,
        and stream what the running ones released."""
        sched = self.scheduler
        for seq in rows:
            if seq.finished and id(seq.group) not in failures:
                sched.cache_finished(seq)
                sched.retire(seq)
                try:
                    self.outputs.close_finished(seq.group)
                except Exception as exc:
                    log.exception("closing failed for %s", seq.group.request.request_id)
                    failures[id(seq.group)] = (seq.group, request_error(exc, "output handling"))
        sched.fail(failures)
        groups = {id(s.group): s.group for s in rows if id(s.group) not in failures}
        self.outputs.emit_stream_deltas(list(groups.values()))

    def _observe_tokens(self, rows: list[Sequence]) -> None:
        self.stats.generation_tokens += len(rows)
        now = time.monotonic()
        for seq in rows:
            if seq.last_token_at is not None:
                self.stats.observe("inter_token_latency", now - seq.last_token_at)
            seq.last_token_at = now
