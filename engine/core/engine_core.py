"""One engine step: the scheduler admits and plans, the runner runs the forwards, the sampler samples, the
output stage turns tokens into outputs (with the one stop decision), and the scheduler retires and releases.

A step prefills first (one batched forward of short prompts, each from its cached prefix if it has one, or
token-budgeted chunks of one prompt at a time), then decodes every running row. New candidates are placed
(every one of a step's prefilled requests) before any of them is sampled, so a candidate that finishes on its
first token can only move rows that already sit at their own slot (engine.core.slots).

Failures are kept to the request they belong to: a prefill, a row's forward (e.g. its adapter), a row's
sampling step or its output handling fails that request with `inference_error` and the batch goes on (a failed
batched forward is retried one request or row at a time). Only a fault of the shared device state is fatal:
it propagates, and the engine loop fails everything.
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
from engine.core.step_timing import StepTiming
from engine.errors import EngineError, is_device_fault, request_error
from engine.runner.model_runner import ModelRunner
from engine.sampling.sampler import Sampler
from engine.staging import stage

log = logging.getLogger(__name__)

Failures = dict[int, tuple[SequenceGroup, EngineError]]  # id(group) -> (group, its error)


class EngineCore:
    def __init__(self, runner: ModelRunner, sampler: Sampler, tokenizer, prefill_budget: int = 1024,
                 kv_budget_tokens: int | None = None, prefix_cache_tokens: int = 0,
                 postprocess: Postprocess | None = None, reasoning: bool = False,
                 publish_kv_events: Callable[[list[dict[str, Any]]], None] | None = None) -> None:
        """`postprocess`: hook(seq) -> extra closing fields (tool calls, strict-grammar checks);
        `publish_kv_events`: takes each step's KV events (engine.core.kv_events), when a router wants them."""
        self.runner = runner
        self.sampler = sampler
        self.scheduler = Scheduler(runner, sampler.counts, tokenizer, prefill_budget, kv_budget_tokens,
                                   prefix_cache_tokens, reasoning, publish_kv_events)
        self.stats = self.scheduler.stats
        self.outputs = OutputStage(tokenizer, sampler.stop_token_set, self.stats, postprocess)
        self.timing = StepTiming()  # where a decode step's time goes (bench/engine.py prints it)

    def step(self) -> None:
        self.timing.start()
        self.scheduler.reap_cancelled()
        self._recompute(self._prefill(self.scheduler.prefill_budget))
        self.scheduler.make_room()
        self.timing.lap("schedule")
        decoding = len(self.scheduler.slots.decoding)
        if decoding:
            self._decode()
        self.scheduler.end_step()
        self.timing.lap("schedule")
        self.timing.end(decoding)

    # -- prefill -------------------------------------------------------------------------------

    def _recompute(self, budget: int) -> None:
        """Bring preempted candidates back, oldest first: their prompt and streamed tokens prefilled again within
        what new prompts left of the step's prefill budget (a candidate joins the decode rows once all its K/V is
        back; nothing is sampled)."""
        sched = self.scheduler
        while budget > 0 and (job := sched.start_recompute()) is not None:
            self.timing.prefilled()
            seq = job.seq
            end = min(job.prefilled + budget, len(job.tokens))
            embeds = seq.group.request.prompt_embeds  # image requests: the prompt's positions take its embeddings
            if embeds is not None:
                if job.prefilled < len(seq.prompt_ids):
                    end = min(end, len(seq.prompt_ids))
                    embeds = embeds[job.prefilled : end]
                else:
                    embeds = None
            try:
                sched.slots.grow(seq, end)
                self.runner.prefill_part(seq.slot, job.tokens[job.prefilled : end], job.prefilled,
                                         adapter=seq.params.lora_adapter, embeds=embeds)
            except Exception as exc:  # as a prefill: the request fails, the engine goes on
                log.exception("recomputing a preempted candidate failed for %s", seq.group.request.request_id)
                sched.abort(seq.group, "error", request_error(exc, "prefill"))
                continue
            budget -= end - job.prefilled
            job.prefilled = seq.kv_len = end
            if end == len(job.tokens):
                sched.slots.resume(job)

    def _prefill(self, budget: int) -> int:
        """New prompts within the step's prefill budget, before any recompute (engine.core.preemption): a whole
        batch of short ones, or chunks of one at a time. Returns the budget left."""
        sched = self.scheduler
        if sched.slots.prefilling is None:
            batch = sched.take_short_prompts(budget)
            if len(batch) > 1:
                self.timing.prefilled()
                self._prefill_batch(batch)
                return budget - sum(len(g.request.prompt_ids) - g.cached_tokens for g in batch)
            sched.requeue(batch)  # a single prompt takes the (chunkable) path below
        while budget > 0 and (group := sched.start_prefill()) is not None:
            self.timing.prefilled()
            parent, prompt = group.sequences[0], group.request.prompt_ids
            chunk = prompt[group.prefilled : group.prefilled + budget]
            embeds = group.request.prompt_embeds  # image requests: precomputed prompt input embeddings
            if embeds is not None:
                embeds = embeds[group.prefilled : group.prefilled + len(chunk)]
            last = group.prefilled + len(chunk) == len(prompt)
            try:
                sched.slots.grow(parent, group.prefilled + len(chunk))
                fill = self.runner.prefill if last else self.runner.prefill_part  # only the last chunk samples
                logits = fill(parent.slot, chunk, group.prefilled, adapter=group.params.lora_adapter, embeds=embeds)
            except Exception as exc:  # a forward failure on one prompt must not take the engine down
                log.exception("prefill failed for %s", group.request.request_id)
                sched.abort(group, "error", request_error(exc, "prefill"))
                continue
            group.prefilled += len(chunk)
            parent.kv_len = group.prefilled
            budget -= len(chunk)
            if last:
                assert logits is not None
                sched.slots.prefilling = None
                rows = sched.place(group)
                self._sample_and_advance(logits[None].repeat(len(rows), 1), rows)
                self._cache_prompts([group])
        return budget

    def _prefill_batch(self, groups: list[SequenceGroup]) -> None:
        """Several short prompts in one forward: a step's cost is mostly reading the weights once."""
        sched = self.scheduler
        slot = len(sched.slots.decoding)
        for group in groups:
            parent = sched.new_parent(group)
            sched.slots.seat(parent, slot)
            sched.load_cached_prefix(group)  # a cached prefix: only the rest of the prompt runs
            sched.slots.grow(parent, len(group.request.prompt_ids))
            slot += group.params.width  # its n/best_of children take the slots right after it
        try:
            logits = self.runner.prefill_batch(
                [g.sequences[0].slot for g in groups], [g.request.prompt_ids[g.prefilled:] for g in groups],
                [g.params.lora_adapter for g in groups], starts=[g.prefilled for g in groups])
        except Exception as exc:  # a forward failure must not take the engine down
            if is_device_fault(exc):
                raise
            log.exception("batched prefill failed; prefilling its requests one by one")
            self._prefill_groups_alone(groups)
            return
        rows: list[Sequence] = []
        for group in groups:
            group.prefilled = len(group.request.prompt_ids)
            group.sequences[0].kv_len = group.prefilled
            rows += sched.place(group)
        if len(rows) > len(groups):  # n/best_of: each candidate samples from its prompt's logits
            # given its output size, repeat_interleave needs no host sync to size the result
            widths = stage([g.params.width for g in groups], torch.long, logits.device)
            logits = logits.repeat_interleave(widths, dim=0, output_size=len(rows))
        self._sample_and_advance(logits, rows)
        self._cache_prompts(groups)

    def _cache_prompts(self, groups: list[SequenceGroup]) -> None:
        """Store each prompt's K/V in the prefix cache once its first token is out: the copy (72 MB for 1.5k tokens
        in fp32, 6-21 ms) was on the path to that token. A parent that already finished stored prompt and output
        on retiring (stop or length), or is gone."""
        for group in groups:
            if not group.sequences[0].finished:
                self.scheduler.cache_prompt(group)

    def _prefill_groups_alone(self, groups: list[SequenceGroup]) -> None:
        """After a failed batched prefill: each prompt alone, so only the requests whose own forward fails
        (e.g. their adapter) fail. Slots are handed out again over the survivors only."""
        slot = len(self.scheduler.slots.decoding)
        survivors: list[tuple[SequenceGroup, torch.Tensor]] = []
        for group in groups:
            prompt, parent = group.request.prompt_ids, group.sequences[0]
            # the whole prompt runs again, in what may be another slot, into blocks of its own (a cached prefix's
            # blocks are shared: nothing may write them again)
            self.scheduler.slots.free(parent)
            self.scheduler.slots.seat(parent, slot)
            self.scheduler.slots.grow(parent, len(prompt))
            group.cached_tokens = 0
            try:
                logits = self.runner.prefill(slot, prompt, 0, adapter=group.params.lora_adapter)
            except Exception as exc:
                self.scheduler.abort(group, "error", request_error(exc, "prefill"))
                continue
            group.prefilled = group.sequences[0].kv_len = len(prompt)
            survivors.append((group, logits))
            slot += group.params.width
        rows: list[Sequence] = []
        for group, _ in survivors:
            rows += self.scheduler.place(group)  # every survivor is placed before any is sampled
        if rows:
            self._sample_and_advance(torch.cat([row[None].repeat(g.params.width, 1) for g, row in survivors]), rows)

    # -- decode --------------------------------------------------------------------------------

    def _decode(self) -> None:
        rows = list(self.scheduler.slots.decoding)
        tokens = [s.output_ids[-1] for s in rows]
        positions = [s.kv_len for s in rows]
        adapters = [s.params.lora_adapter for s in rows]
        self.timing.lap("stage")
        try:
            logits = self.runner.decode(tokens, positions, adapters)
        except Exception as exc:
            if is_device_fault(exc):
                raise
            log.exception("batched decode failed; retrying its rows one by one")
            self._decode_rows_alone(rows)
            return
        for s in rows:
            s.kv_len += 1
        self.timing.lap("forward")
        self._sample_and_advance(logits, rows)

    def _decode_rows_alone(self, rows: list[Sequence]) -> None:
        """After a failed batched step: one forward per row (a one-token prefill at its position writes
        the same K/V), so that only the rows whose own forward fails (e.g. their adapter) fail."""
        ok: list[Sequence] = []
        row_logits: list[torch.Tensor] = []
        failures: Failures = {}
        for seq in rows:
            if id(seq.group) in failures:
                continue
            try:
                row_logits.append(self.runner.prefill(seq.slot, seq.output_ids[-1:], seq.kv_len,
                                                      adapter=seq.params.lora_adapter))
            except Exception as exc:
                failures[id(seq.group)] = (seq.group, request_error(exc, "decode"))
                continue
            ok.append(seq)
        keep = [i for i, seq in enumerate(ok) if id(seq.group) not in failures]
        ok = [ok[i] for i in keep]
        for seq in ok:
            seq.kv_len += 1
        self.scheduler.fail(failures)  # after the good rows' K/V is counted: their lengths are right when rows move
        if ok:
            self._sample_and_advance(torch.stack([row_logits[i] for i in keep]), ok)

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
