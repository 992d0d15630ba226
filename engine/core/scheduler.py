"""Iteration-level continuous batching: admit, prefill (token-budgeted), decode, retire.

KV slots and reservations live in the slot table (engine.core.slots, which states the slot invariant). New
candidates are placed (every one of a step's prefilled requests) before any of them is sampled, so a candidate
that finishes on its first token can only move rows that already sit at their own slot.

Failures are kept to the request they belong to: a prefill, a row's forward (e.g. its adapter), a
row's sampling step or its output handling fails that request with `inference_error` and the batch
goes on. Only a fault of the shared device state is fatal (the engine loop then fails everything).
"""

from __future__ import annotations

import collections
import hashlib
import logging
import time

import torch

from engine.core.output_processor import OutputStage, Postprocess
from engine.core.prefix_cache import PrefixCache
from engine.core.sequence import Sequence, SequenceGroup, candidate_generator
from engine.core.slots import SlotTable
from engine.core.stats import EngineStats
from engine.errors import EngineError, is_device_fault, request_error
from engine.request import EngineRequest, RequestOutput
from engine.runner.model_runner import ModelRunner
from engine.sampling.sampler import Sampler
from engine.staging import stage

log = logging.getLogger(__name__)


class Scheduler:
    def __init__(self, runner: ModelRunner, sampler: Sampler, tokenizer, prefill_budget: int = 512,
                 kv_budget_tokens: int | None = None, prefix_cache_tokens: int = 0,
                 postprocess: Postprocess | None = None, reasoning: bool = False) -> None:
        """`postprocess`: hook(seq) -> extra closing fields (tool calls, strict-grammar checks); `reasoning`:
        the model thinks in <think>...</think> (its profile says so)."""
        self.runner = runner
        self.sampler = sampler
        self.tokenizer = tokenizer
        self.prefill_budget = prefill_budget
        self.slots = SlotTable(runner.cache, kv_budget_tokens)
        self.max_slots, self.max_len, self.kv_budget = self.slots.max_slots, self.slots.max_len, self.slots.kv_budget
        self.waiting: collections.deque[SequenceGroup] = collections.deque()
        self.stats = EngineStats(kv_budget=self.kv_budget)
        self.outputs = OutputStage(tokenizer, sampler.stop_token_set, self.stats, postprocess)
        # K/V of past prompts and outputs, reused by requests that start the same way (0 tokens: off)
        self.prefix_cache = PrefixCache(runner.cache, prefix_cache_tokens) if prefix_cache_tokens > 0 else None
        self.reasoning = reasoning

    # -- admission -----------------------------------------------------------------------------

    def add(self, request: EngineRequest) -> None:
        params = request.params
        prompt_len = len(request.prompt_ids)
        if prompt_len == 0:
            raise EngineError("invalid_request", "prompt is empty", request.prompt_param)
        if prompt_len >= self.max_len:
            raise EngineError(
                "context_exceeded",
                f"prompt has {prompt_len} tokens; this model accepts at most {self.max_len - 1}",
                request.prompt_param,
            )
        adapter = params.lora_adapter
        if adapter is not None and adapter not in self.runner.adapters:
            raise EngineError("unknown_lora_adapter", f"unknown LoRA adapter '{adapter}'", "lora_adapter")
        if params.width > self.max_slots:
            raise EngineError(
                "invalid_request",
                f"n/best_of of {params.width} exceeds this engine's {self.max_slots} concurrent sequences",
                "best_of" if params.best_of else "n",
            )
        room = self.max_len - prompt_len
        if params.max_tokens > room:
            if not params.clamp_max_tokens:  # the client's own cap: say so, as vLLM and OpenAI do
                raise EngineError(
                    "context_exceeded",
                    f"the prompt ({prompt_len} tokens) plus '{params.max_tokens_param}' ({params.max_tokens}) "
                    f"exceeds this model's context of {self.max_len} tokens",
                    params.max_tokens_param,
                )
            params.max_tokens = room  # a default cap: generation never runs past the cache
            params.min_tokens = min(params.min_tokens, room)
        group = SequenceGroup(request)
        if self.reasoning:
            group.reasoning = True
            group.thinking_open = self.tokenizer.decode(request.prompt_ids[-8:]).rstrip().endswith("<think>")
        if group.kv_need > self.kv_budget:
            raise EngineError(
                "invalid_request",
                f"n x (prompt + max tokens) = {group.kv_need} token positions exceeds this engine's KV budget "
                f"of {self.kv_budget}; lower n/best_of or the token limit",
                "n" if params.width > 1 else params.max_tokens_param,
            )
        self.waiting.append(group)

    def _admit(self, group: SequenceGroup) -> None:
        self.slots.reserve(group)
        if group.admitted_at is None:  # once: a single short prompt is admitted again on the chunked path
            group.admitted_at = time.monotonic()
            self.stats.observe("request_queue_time", group.admitted_at - group.request.arrival)
            self.stats.prompt_tokens += len(group.request.prompt_ids)
            if self.prefix_cache is not None:
                self.stats.prefix_queries += len(group.request.prompt_ids)

    @property
    def queue_depth(self) -> int:
        return len(self.waiting)

    def has_work(self) -> bool:
        return bool(self.waiting) or self.slots.busy()

    # -- one iteration -------------------------------------------------------------------------

    def step(self) -> None:
        self._reap_cancelled()
        self._prefill()
        if self.slots.decoding:
            self._decode()
        self.stats.running = len({id(s.group) for s in self.slots.decoding}) + (self.slots.prefilling is not None)
        self.stats.kv_reserved = self.slots.reserved
        if not self.has_work():
            self.slots.release_all()

    def _reap_cancelled(self) -> None:
        groups = {id(s.group): s.group for s in self.slots.decoding}
        if self.slots.prefilling is not None:
            groups[id(self.slots.prefilling)] = self.slots.prefilling
        for group in list(self.waiting) + list(groups.values()):
            check = group.request.is_cancelled
            if check is not None and check():
                self.abort(group, "cancelled")

    def abort(self, group: SequenceGroup, reason: str, error: EngineError | None = None) -> None:
        """Drop a request wherever it is, free its slots, and end it with one final output."""
        if group in self.waiting:
            self.waiting.remove(group)
        self.slots.drop_prefill(group)
        for seq in [s for s in self.slots.decoding if s.group is group]:
            self._retire(seq)
        self.slots.release(group)
        if reason == "cancelled":
            self.stats.cancelled += 1
        if not group.sent_final:
            self.stats.finish(reason)
            group.emit(RequestOutput("", 0, "", finish_reason=reason, final=True, error=error))

    def _fail(self, failures: dict[int, tuple[SequenceGroup, EngineError]]) -> None:
        for group, error in failures.values():
            log.warning("request %s failed: %s", group.request.request_id, error.message)
            self.abort(group, "error", error)

    def _new_parent(self, group: SequenceGroup) -> Sequence:
        parent = Sequence(group, 0, candidate_generator(group.params.seed, 0), self.tokenizer)
        if group.request.grammar is not None:
            parent.grammar = group.request.grammar()
        group.sequences = [parent]
        return parent

    # -- prefill -------------------------------------------------------------------------------

    def _take_short_prompts(self, budget: int) -> list[SequenceGroup]:
        """Waiting requests whose whole prompt fits the step's budget (FIFO), for one batched prefill."""
        batch: list[SequenceGroup] = []
        slots, reserved = len(self.slots.decoding), self.slots.reserved
        for group in self.waiting:
            size = len(group.request.prompt_ids)
            if size > budget or group.request.prompt_embeds is not None or not self.slots.fits(group, slots, reserved):
                break
            if self.prefix_cache is not None and self.prefix_cache.lookup(group.request.prompt_ids,
                                                                          self._cache_salt(group), touch=False):
                break  # a cached prefix: only its rest is prefilled, on the chunked path
            batch.append(group)
            budget -= size
            slots += group.params.width
            reserved += group.kv_need
        for group in batch:
            self.waiting.popleft()
            self._admit(group)
        return batch

    def _prefill_batch(self, groups: list[SequenceGroup]) -> None:
        """Several short prompts in one forward: a step's cost is mostly reading the weights once."""
        slot = len(self.slots.decoding)
        for group in groups:
            self._new_parent(group).slot = slot
            slot += group.params.width  # its n/best_of children take the slots right after it
        try:
            logits = self.runner.prefill_batch(
                [g.sequences[0].slot for g in groups], [g.request.prompt_ids for g in groups],
                [g.params.lora_adapter for g in groups])
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
            self._cache_prompt(group)
            rows += self._place(group)
        if len(rows) > len(groups):  # n/best_of: each candidate samples from its prompt's logits
            # given its output size, repeat_interleave needs no host sync to size the result
            widths = stage([g.params.width for g in groups], torch.long, logits.device)
            logits = logits.repeat_interleave(widths, dim=0, output_size=len(rows))
        self._sample_and_advance(logits, rows)

    def _prefill_groups_alone(self, groups: list[SequenceGroup]) -> None:
        """After a failed batched prefill: each prompt alone, so only the requests whose own forward fails
        (e.g. their adapter) fail. Slots are handed out again over the survivors only."""
        slot = len(self.slots.decoding)
        survivors: list[tuple[SequenceGroup, torch.Tensor]] = []
        for group in groups:
            prompt = group.request.prompt_ids
            group.sequences[0].slot = slot
            try:
                logits = self.runner.prefill(slot, prompt, 0, adapter=group.params.lora_adapter)
            except Exception as exc:
                self.abort(group, "error", request_error(exc, "prefill"))
                continue
            group.prefilled = group.sequences[0].kv_len = len(prompt)
            survivors.append((group, logits))
            slot += group.params.width
        rows: list[Sequence] = []
        for group, _ in survivors:
            rows += self._place(group)  # every survivor is placed before any is sampled (see the invariant)
        if rows:
            self._sample_and_advance(torch.cat([row[None].repeat(g.params.width, 1) for g, row in survivors]), rows)

    def _prefill(self) -> None:
        budget = self.prefill_budget
        if self.slots.prefilling is None:
            batch = self._take_short_prompts(budget)
            if len(batch) > 1:
                self._prefill_batch(batch)
                return
            for group in batch:  # a single prompt takes the (chunkable) path below
                self.slots.release(group)
                self.waiting.appendleft(group)
        while budget > 0:
            if self.slots.prefilling is None:
                if not self.waiting:
                    return
                group = self.waiting[0]
                if not self.slots.fits(group, len(self.slots.decoding), self.slots.reserved):
                    return  # wait for slots / KV budget to free up
                self.waiting.popleft()
                self._admit(group)
                self.slots.prefilling = group
                self._load_cached_prefix(group, self._new_parent(group))
            group = self.slots.prefilling
            parent = group.sequences[0]
            parent.slot = len(self.slots.decoding)
            prompt = group.request.prompt_ids
            chunk = prompt[group.prefilled : group.prefilled + budget]
            embeds = group.request.prompt_embeds  # image requests: precomputed prompt input embeddings
            if embeds is not None:
                embeds = embeds[group.prefilled : group.prefilled + len(chunk)]
            try:
                logits = self.runner.prefill(parent.slot, chunk, group.prefilled,
                                              adapter=group.params.lora_adapter, embeds=embeds)
            except Exception as exc:  # a forward failure on one prompt must not take the engine down
                error = request_error(exc, "prefill")
                log.exception("prefill failed for %s", group.request.request_id)
                self.abort(group, "error", error)
                continue
            group.prefilled += len(chunk)
            parent.kv_len = group.prefilled
            budget -= len(chunk)
            if group.prefilled == len(prompt):
                self.slots.prefilling = None
                self._cache_prompt(group)
                rows = self._place(group)
                self._sample_and_advance(logits[None].repeat(len(rows), 1), rows)

    # -- prefix cache --------------------------------------------------------------------------

    @staticmethod
    def _cache_salt(group: SequenceGroup) -> object:
        """What the K/V depends on besides the token ids: the adapter, and the image inputs."""
        if group.cache_salt is None:
            embeds = group.request.prompt_embeds
            digest = None
            if embeds is not None:
                digest = hashlib.blake2b(embeds.detach().float().cpu().numpy().tobytes(), digest_size=16).hexdigest()
            group.cache_salt = (group.params.lora_adapter, digest)
        return group.cache_salt

    def _load_cached_prefix(self, group: SequenceGroup, parent: Sequence) -> None:
        if self.prefix_cache is None:
            return
        parent.slot = len(self.slots.decoding)
        rows = self.prefix_cache.lookup(group.request.prompt_ids, self._cache_salt(group))
        group.prefilled = parent.kv_len = group.cached_tokens = self.prefix_cache.load(rows, parent.slot)
        self.stats.prefix_hits += group.cached_tokens

    def _cache_prompt(self, group: SequenceGroup) -> None:
        if self.prefix_cache is not None:
            parent = group.sequences[0]
            self.prefix_cache.store(group.request.prompt_ids, self._cache_salt(group), parent.slot, parent.kv_len)

    def _cache_finished(self, seq: Sequence) -> None:
        """A finished candidate's prompt + output K/V (a chat's next turn starts with both)."""
        if self.prefix_cache is not None and seq.finish_reason in ("stop", "length"):
            self.prefix_cache.store(seq.prompt_ids + seq.output_ids, self._cache_salt(seq.group), seq.slot,
                                    seq.kv_len)

    def _place(self, group: SequenceGroup) -> list[Sequence]:
        """Fork the prefilled parent into its n/best_of candidates and append them to the decode rows."""
        parent = group.sequences[0]
        children = [parent.fork(i, candidate_generator(group.params.seed, i), self.tokenizer)
                    for i in range(1, group.params.width)]
        rows = self.slots.place(group, children)
        group.first_token_at = time.monotonic()
        self.stats.observe("time_to_first_token", group.first_token_at - group.request.arrival)
        self.stats.observe("request_prefill_time", group.first_token_at - (group.admitted_at or group.request.arrival))
        return rows

    # -- decode --------------------------------------------------------------------------------

    def _decode(self) -> None:
        rows = list(self.slots.decoding)
        tokens = [s.output_ids[-1] for s in rows]
        positions = [s.kv_len for s in rows]
        adapters = [s.params.lora_adapter for s in rows]
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
        self._sample_and_advance(logits, rows)

    def _decode_rows_alone(self, rows: list[Sequence]) -> None:
        """After a failed batched step: one forward per row (a one-token prefill at its position writes
        the same K/V), so that only the rows whose own forward fails (e.g. their adapter) fail."""
        ok: list[Sequence] = []
        row_logits: list[torch.Tensor] = []
        failures: dict[int, tuple[SequenceGroup, EngineError]] = {}
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
        self._fail(failures)  # after the K/V of the good rows is counted, so compaction moves all of it
        if ok:
            self._sample_and_advance(torch.stack([row_logits[i] for i in keep]), ok)

    # -- sampling and outputs ------------------------------------------------------------------

    def _sample_and_advance(self, logits: torch.Tensor, rows: list[Sequence]) -> None:
        masks = {i: s.grammar.apply_mask for i, s in enumerate(rows) if s.grammar is not None}
        failures: dict[int, tuple[SequenceGroup, EngineError]] = {}
        try:
            out = self.sampler.sample(logits, rows, masks)
        except Exception as exc:
            if is_device_fault(exc):
                raise
            log.exception("sampling failed")
            self._fail({id(s.group): (s.group, request_error(exc, "sampling")) for s in rows})
            return
        for i, error in out.row_errors.items():
            failures.setdefault(id(rows[i].group), (rows[i].group, request_error(error, "sampling")))
        self.stats.generation_tokens += len(rows)
        now = time.monotonic()
        for seq in rows:
            if seq.last_token_at is not None:
                self.stats.observe("inter_token_latency", now - seq.last_token_at)
            seq.last_token_at = now
        for i, seq in enumerate(rows):
            if id(seq.group) in failures:
                continue
            try:
                self.outputs.advance(seq, out.tokens[i], out.logprobs[i], out.top[i] if out.top else None)
            except Exception as exc:
                failures[id(seq.group)] = (seq.group, request_error(exc, "output handling"))
                log.exception("output handling failed for %s", seq.group.request.request_id)
        for seq in rows:
            if seq.finished and id(seq.group) not in failures:
                self._cache_finished(seq)
                self._retire(seq)
                try:
                    if self.outputs.close_finished(seq.group):
                        self.slots.release(seq.group)
                except Exception as exc:
                    log.exception("closing failed for %s", seq.group.request.request_id)
                    failures[id(seq.group)] = (seq.group, request_error(exc, "output handling"))
        self._fail(failures)
        groups = {id(s.group): s.group for s in rows if id(s.group) not in failures}
        self.outputs.emit_stream_deltas(list(groups.values()))

    def _retire(self, seq: Sequence) -> None:
        if self.slots.retire(seq):
            self.sampler.counts.release(seq)  # its penalty-count row, now (not when the cyclic GC runs)
