"""Iteration-level continuous batching: admit, prefill (token-budgeted), decode, retire.

Invariant: decoding sequences occupy KV slots 0..B-1 in `self.decoding` order, and a request in
prefill holds slot B (its first candidate). A retiring sequence's slot is filled by the last row,
so the decode step always reads plain views of the cache.
"""

from __future__ import annotations

import collections
import logging
import random
import time

import torch

from engine.errors import EngineError
from engine.forward import DecoderForward
from engine.lora import LoraBatch
from engine.outputs import CandidateOutputs
from engine.sampler import Sampler
from engine.sequence import EngineRequest, RequestOutput, Sequence, SequenceGroup
from engine.stats import EngineStats

log = logging.getLogger(__name__)


class Scheduler(CandidateOutputs):
    def __init__(self, forward: DecoderForward, sampler: Sampler, tokenizer, prefill_budget: int = 512,
                 kv_budget_tokens: int | None = None) -> None:
        self.forward = forward
        self.sampler = sampler
        self.tokenizer = tokenizer
        self.prefill_budget = prefill_budget
        self.max_slots = forward.cache.slots
        self.max_len = forward.cache.max_len
        # admission control on KV memory: running requests reserve width x (prompt + max_tokens) positions
        self.kv_budget = kv_budget_tokens or self.max_slots * self.max_len
        self.reserved = 0
        self.waiting: collections.deque[SequenceGroup] = collections.deque()
        self.prefilling: SequenceGroup | None = None
        self.decoding: list[Sequence] = []
        self.stats = EngineStats()
        self.postprocess = None  # optional hook(seq) -> dict of extra output fields, set by the engine
        self.reasoning = False  # the model declares reasoning (profile); set by the engine

    # -- admission -----------------------------------------------------------------------------

    def add(self, request: EngineRequest) -> None:
        prompt_len = len(request.prompt_ids)
        if prompt_len == 0:
            raise EngineError("invalid_request", "prompt is empty", request.prompt_param)
        if prompt_len >= self.max_len:
            raise EngineError(
                "context_exceeded",
                f"prompt has {prompt_len} tokens; this model accepts at most {self.max_len - 1}",
                request.prompt_param,
            )
        adapter = request.params.lora_adapter
        if adapter is not None and adapter not in self.forward.adapters:
            raise EngineError("unknown_lora_adapter", f"unknown LoRA adapter '{adapter}'", "lora_adapter")
        if request.params.width > self.max_slots:
            raise EngineError(
                "invalid_request",
                f"n/best_of of {request.params.width} exceeds this engine's {self.max_slots} concurrent sequences",
                "best_of" if request.params.best_of else "n",
            )
        # generation never runs past the cache: clamp the budget, finishing with "length"
        request.params.max_tokens = min(request.params.max_tokens, self.max_len - prompt_len)
        group = SequenceGroup(request)
        if self.reasoning:
            group.reasoning = True
            group.thinking_open = self.tokenizer.decode(request.prompt_ids[-8:]).rstrip().endswith("<think>")
        if group.kv_need > self.kv_budget:
            raise EngineError(
                "invalid_request",
                f"n x (prompt + max tokens) = {group.kv_need} token positions exceeds this engine's KV budget "
                f"of {self.kv_budget}; lower n/best_of or the token limit",
                "n" if request.params.width > 1 else "max_tokens",
            )
        self.waiting.append(group)

    def _fits(self, group: SequenceGroup, slots_in_use: int, reserved: int) -> bool:
        return slots_in_use + group.params.width <= self.max_slots and reserved + group.kv_need <= self.kv_budget

    def _admit(self, group: SequenceGroup) -> None:
        self.reserved += group.kv_need
        group.admitted = True

    def _release(self, group: SequenceGroup) -> None:
        if group.admitted:
            group.admitted = False
            self.reserved -= group.kv_need

    @property
    def queue_depth(self) -> int:
        return len(self.waiting)

    def has_work(self) -> bool:
        return bool(self.waiting or self.prefilling or self.decoding)

    # -- one iteration -------------------------------------------------------------------------

    def step(self) -> None:
        self._reap_cancelled()
        self._prefill()
        if self.decoding:
            self._decode()
        self.stats.running = len(self.decoding)
        self.stats.kv_tokens = sum(s.kv_len for s in self.decoding)

    def _reap_cancelled(self) -> None:
        groups = {id(s.group): s.group for s in self.decoding}
        if self.prefilling is not None:
            groups[id(self.prefilling)] = self.prefilling
        for group in list(self.waiting) + list(groups.values()):
            check = group.request.is_cancelled
            if check is not None and check():
                self.abort(group, "cancelled")

    def abort(self, group: SequenceGroup, reason: str, error: EngineError | None = None) -> None:
        """Drop a request wherever it is, free its slots, and end it with one final output."""
        if group in self.waiting:
            self.waiting.remove(group)
        if self.prefilling is group:
            self.prefilling = None
        for seq in [s for s in self.decoding if s.group is group]:
            self._retire(seq)
        self._release(group)
        if reason == "cancelled":
            self.stats.cancelled += 1
        if not group.sent_final:
            group.emit(RequestOutput("", 0, "", finish_reason=reason, final=True, error=error))

    def _new_parent(self, group: SequenceGroup) -> Sequence:
        parent = Sequence(group, 0, self._generator(group, 0), self.tokenizer)
        if group.request.grammar is not None:
            parent.grammar = group.request.grammar()
        group.sequences = [parent]
        return parent

    def _take_short_prompts(self, budget: int) -> list[SequenceGroup]:
        """Waiting requests whose whole prompt fits the step's budget (FIFO), for one batched prefill."""
        batch: list[SequenceGroup] = []
        slots, reserved = len(self.decoding), self.reserved
        for group in self.waiting:
            size = len(group.request.prompt_ids)
            if size > budget or group.request.prompt_embeds is not None or not self._fits(group, slots, reserved):
                break
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
        slot = len(self.decoding)
        for group in groups:
            self._new_parent(group).slot = slot
            slot += group.params.width  # its n/best_of children take the slots right after it
        try:
            logits = self.forward.prefill_batch(
                [g.sequences[0].slot for g in groups], [g.request.prompt_ids for g in groups],
                [g.params.lora_adapter for g in groups])
        except Exception as exc:  # a forward failure must not take the engine down
            log.exception("batched prefill failed")
            for group in groups:
                self.abort(group, "error", EngineError("inference_error", f"prefill failed: {type(exc).__name__}"))
            return
        for group, row in zip(groups, logits, strict=True):
            group.prefilled = len(group.request.prompt_ids)
            group.sequences[0].kv_len = group.prefilled
            self._start_decoding(group, row)

    def _prefill(self) -> None:
        budget = self.prefill_budget
        if self.prefilling is None:
            batch = self._take_short_prompts(budget)
            if len(batch) > 1:
                self._prefill_batch(batch)
                return
            for group in batch:  # a single prompt takes the (chunkable) path below
                self._release(group)
                self.waiting.appendleft(group)
        while budget > 0:
            if self.prefilling is None:
                if not self.waiting:
                    return
                group = self.waiting[0]
                if not self._fits(group, len(self.decoding), self.reserved):
                    return  # wait for slots / KV budget to free up
                self.waiting.popleft()
                self._admit(group)
                self.prefilling = group
                self._new_parent(group)
            group = self.prefilling
            parent = group.sequences[0]
            parent.slot = len(self.decoding)
            prompt = group.request.prompt_ids
            chunk = prompt[group.prefilled : group.prefilled + budget]
            embeds = group.request.prompt_embeds  # image requests: precomputed prompt input embeddings
            if embeds is not None:
                embeds = embeds[group.prefilled : group.prefilled + len(chunk)]
            try:
                logits = self.forward.prefill(parent.slot, torch.tensor(chunk), group.prefilled,
                                              adapter=group.params.lora_adapter, embeds=embeds)
            except Exception as exc:  # a forward failure on one prompt must not take the engine down
                log.exception("prefill failed for %s", group.request.request_id)
                self.abort(group, "error", EngineError("inference_error", f"prefill failed: {type(exc).__name__}"))
                continue
            group.prefilled += len(chunk)
            parent.kv_len = group.prefilled
            budget -= len(chunk)
            if group.prefilled == len(prompt):
                self.prefilling = None
                self._start_decoding(group, logits)

    def _start_decoding(self, group: SequenceGroup, logits: torch.Tensor) -> None:
        parent = group.sequences[0]
        for index in range(1, group.params.width):
            child = parent.fork(index, self._generator(group, index), self.tokenizer)
            child.slot = parent.slot + index
            self.forward.cache.copy_slot(parent.slot, child.slot, parent.kv_len)
            group.sequences.append(child)
        self.decoding.extend(group.sequences)
        group.first_token_at = time.monotonic()
        self.stats.observe_ttft(group.first_token_at - group.request.arrival)
        rows = group.sequences
        self._sample_and_advance(logits.unsqueeze(0).expand(len(rows), -1).clone(), rows)

    def _decode(self) -> None:
        rows = list(self.decoding)
        tokens = torch.tensor([s.output_ids[-1] for s in rows])
        positions = torch.tensor([s.kv_len for s in rows])
        adapters = [s.params.lora_adapter for s in rows]
        lora = LoraBatch(self.forward.adapters, adapters) if any(adapters) else None
        logits = self.forward.decode(tokens, positions, int(positions.max()) + 1, lora)
        for s in rows:
            s.kv_len += 1
        self._sample_and_advance(logits, rows)

    def _sample_and_advance(self, logits: torch.Tensor, rows: list[Sequence]) -> None:
        masks = {i: s.grammar.apply_mask for i, s in enumerate(rows) if s.grammar is not None}
        out = self.sampler.sample(logits, rows, masks)
        self.stats.generated_tokens += len(rows)
        for i, seq in enumerate(rows):
            self._advance(seq, out.tokens[i], out.logprobs[i], out.top[i] if out.top else None)
        for seq in rows:
            if seq.finished:
                self._retire(seq)
                self._maybe_finish_group(seq.group)
        for group in {id(s.group): s.group for s in rows}.values():
            if group.request.stream and not group.buffered and not group.sent_final:
                for seq in group.sequences:
                    if not seq.finished and (seq.text or seq.reasoning or seq.unsent_logprobs):
                        self._emit_delta(seq)

    def _retire(self, seq: Sequence) -> None:
        """Free the sequence's slot, moving the last row (and any prefill in progress) down."""
        if seq not in self.decoding:
            return
        index = self.decoding.index(seq)
        last = len(self.decoding) - 1
        if index != last:
            moved = self.decoding[last]
            self.forward.cache.copy_slot(last, index, moved.kv_len)
            moved.slot = index
            self.decoding[index] = moved
        self.decoding.pop()
        if self.prefilling is not None and self.prefilling.prefilled > 0:
            parent = self.prefilling.sequences[0]
            self.forward.cache.copy_slot(parent.slot, len(self.decoding), parent.kv_len)
            parent.slot = len(self.decoding)

    def _generator(self, group: SequenceGroup, index: int) -> torch.Generator:
        seed = group.params.seed
        gen = torch.Generator()
        # children of a seeded request get distinct but reproducible streams
        gen.manual_seed((seed + index) % 2**63 if seed is not None else random.getrandbits(63))
        return gen
