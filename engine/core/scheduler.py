"""Admission and the requests' lifecycle: which waiting requests run, in which rows, and their ending.

It admits requests (the checks of engine.core.admission, then room for their prompts' KV blocks), picks the whole
short prompts for one batched prefill or the next prompt to prefill chunk by chunk, aborts requests (cancelled,
failed), places prefilled candidates and retires finished ones through the slot table (engine.core.slots, which
states the row invariant and how blocks are taken), and keys and reuses the prefix cache's blocks. How a step is
planned from these is engine.core.planner's part; who gives way when the blocks run out, and how they come back,
is engine.core.preemption's. It never runs a forward or samples: that is engine.core.engine_core's step.
"""

from __future__ import annotations

import collections
import itertools
import logging
import time
from collections.abc import Callable, Iterator
from typing import Any

from engine.core import kv_events
from engine.core.admission import check_kv_room, check_request
from engine.core.planner import Planner
from engine.core.preemption import BYPASS_LIMIT, Preemption
from engine.core.prefix_cache import PrefixCache, salt_of
from engine.core.sequence import Sequence, SequenceGroup, candidate_generator
from engine.core.slots import BLOCK_TOKENS, Recompute, SlotTable, blocks, owner
from engine.core.stats import EngineStats
from engine.errors import EngineError
from engine.request import EngineRequest
from engine.runner.model_runner import ModelRunner
from engine.sampling.penalty_counts import PenaltyCounts

log = logging.getLogger(__name__)



class Scheduler(Preemption, Planner):
    def __init__(self, runner: ModelRunner, counts: PenaltyCounts, tokenizer, prefill_budget: int = 1024,
                 kv_budget_tokens: int | None = None, prefix_cache_tokens: int = 0, reasoning: bool = False,
                 publish_kv_events: Callable[[list[dict[str, Any]]], None] | None = None) -> None:
        """`counts`: the sampler's penalty counts (a retired row's is freed at once); `reasoning`: the model
        thinks in <think>...</think> (its profile says so)."""
        self.runner = runner
        self.counts = counts
        self.tokenizer = tokenizer
        self.prefill_budget = prefill_budget
        self.slots = SlotTable(runner.cache, kv_budget_tokens)
        self.max_slots, self.max_len, self.kv_budget = self.slots.max_slots, self.slots.max_len, self.slots.kv_budget
        self.waiting: collections.deque[SequenceGroup] = collections.deque()
        self.preempted: list[Sequence] = []  # candidates waiting to be recomputed (first when they fit)
        self.clock = time.monotonic  # injectable (tests)
        self._admissions = itertools.count()  # admission order: the newest running candidate is preempted first
        self.stats = EngineStats(kv_budget=self.slots.budget_blocks)
        # K/V of past prompts and outputs, reused by requests that start the same way (0 tokens: off)
        self.prefix_cache = PrefixCache(self.slots.pool, prefix_cache_tokens, BLOCK_TOKENS) \
            if prefix_cache_tokens > 0 else None
        # KV events (engine.core.kv_events): the prefix cache records its stored and evicted blocks, sent each step
        self.publish_kv_events = publish_kv_events if self.prefix_cache is not None else None
        if self.publish_kv_events is not None and self.prefix_cache is not None:
            self.prefix_cache.events = []
            self.publish_kv_events([kv_events.all_blocks_cleared()])  # a new process holds no block yet
        self.reasoning = reasoning

    # -- admission -----------------------------------------------------------------------------

    def add(self, request: EngineRequest) -> None:
        """Validate a request (engine.core.admission) and queue it."""
        check_request(request, self.max_len, self.max_slots, self.runner.adapters)
        group = SequenceGroup(request)
        if self.reasoning:
            group.reasoning = True
            group.thinking_open = self.tokenizer.decode(request.prompt_ids[-8:]).rstrip().endswith("<think>")
        check_kv_room(group, self.slots.budget_blocks, self.kv_budget, self.max_len)
        self.waiting.append(group)

    def _claim(self, group: SequenceGroup) -> int:
        """Blocks a new request takes to be prefilled and placed: its prompt and the position of its first token,
        less the cached blocks a running sequence already holds (shared, they take no room), and a copy of a partly
        filled last block for each candidate after the first."""
        prompt = group.request.prompt_ids
        need = blocks(len(prompt) + 1) + group.params.width - 1
        refs = self.slots.pool.refs
        return need - sum(1 for b in self._cached_blocks(group) if refs[b])

    def _admissible(self, slots_in_use: int, available: int, after: int = 0) -> SequenceGroup | None:
        """The first waiting request (from index `after`) that fits now. Not strict FIFO: one that must wait for
        room does not hold back a later one that fits, but each may be passed over at most BYPASS_LIMIT times,
        so a large request is not starved by a stream of small ones."""
        for index in range(after, len(self.waiting)):
            group = self.waiting[index]
            if self.slots.fits(self._claim(group), group.params.width, slots_in_use, available):
                return group
            if group.bypassed >= BYPASS_LIMIT:
                return None  # its turn: nothing goes past it until it fits
        return None

    def _take(self, group: SequenceGroup) -> None:
        """Out of the waiting queue; every request it went past counts one more bypass."""
        index = self.waiting.index(group)
        for passed in itertools.islice(self.waiting, index):
            passed.bypassed += 1
        del self.waiting[index]

    def _admit(self, group: SequenceGroup) -> None:
        for seq in self.preempted:
            seq.bypassed += 1
        group.admission = next(self._admissions)
        if group.admitted_at is None:  # once: a single short prompt is admitted again on the chunked path
            group.admitted_at = time.monotonic()
            self.stats.observe("request_queue_time", group.admitted_at - group.request.arrival)
            self.stats.prompt_tokens += len(group.request.prompt_ids)
            if self.prefix_cache is not None:
                self.stats.prefix_queries += len(group.request.prompt_ids)

    @property
    def queue_depth(self) -> int:
        """Requests waiting: not yet admitted, or preempted (as vLLM counts them)."""
        return len(self.waiting) + len({id(seq.group) for seq in self.preempted})

    def has_work(self) -> bool:
        return bool(self.waiting or self.preempted) or self.slots.busy()

    def groups_in_flight(self) -> Iterator[SequenceGroup]:
        """Every request the scheduler holds, once each: waiting, prefilling, decoding or preempted."""
        seen: dict[int, SequenceGroup] = {id(g): g for g in self.waiting}
        if self.slots.prefilling is not None:
            seen.setdefault(id(owner(self.slots.prefilling)), owner(self.slots.prefilling))
        for seq in self.slots.decoding + self.preempted:
            seen.setdefault(id(seq.group), seq.group)
        return iter(list(seen.values()))

    # -- one step's bookkeeping -----------------------------------------------------------------

    def end_step(self) -> None:
        running = {id(s.group) for s in self.slots.decoding}
        if self.slots.prefilling is not None:
            running.add(id(owner(self.slots.prefilling)))
        self.stats.running = len(running)
        self.stats.kv_used = self.slots.used_blocks()
        self._heartbeat_preempted()
        if self.publish_kv_events is not None and self.prefix_cache is not None and self.prefix_cache.events:
            self.publish_kv_events(self.prefix_cache.events)
            self.prefix_cache.events = []

    def reap_cancelled(self) -> None:
        for group in self.groups_in_flight():
            check = group.request.is_cancelled
            if check is not None and check():
                self.abort(group, "cancelled")

    def abort(self, group: SequenceGroup, reason: str, error: EngineError | None = None) -> None:
        """Drop a request wherever it is, free its slots, and end it with one final output."""
        if group in self.waiting:
            self.waiting.remove(group)
        self.slots.drop_prefill(group)
        self.preempted = [s for s in self.preempted if s.group is not group]
        for seq in [s for s in self.slots.decoding if s.group is group]:
            self.retire(seq)
        for seq in group.sequences:  # a batched prefill's parent holds blocks outside any row
            self.slots.free(seq)
        if reason == "cancelled":
            self.stats.cancelled += 1
        if not group.sent_final:
            self.stats.finish(reason)
            group.end_early(reason, error)

    def fail(self, failures: dict[int, tuple[SequenceGroup, EngineError]]) -> None:
        for group, error in failures.values():
            log.warning("request %s failed: %s", group.request.request_id, error.message)
            self.abort(group, "error", error)

    def new_parent(self, group: SequenceGroup) -> Sequence:
        parent = Sequence(group, 0, candidate_generator(group.params.seed, 0), self.tokenizer)
        if group.request.grammar is not None:
            parent.grammar = group.request.grammar()
        group.sequences = [parent]
        return parent

    # -- prefill -------------------------------------------------------------------------------

    def take_short_prompts(self, budget: int) -> list[SequenceGroup]:
        """Waiting requests whose prompt (past its cached prefix) fits the step's budget (in order, see
        _admissible), for one batched prefill."""
        batch: list[SequenceGroup] = []
        if self._preempted_turn():
            return batch
        slots, available = len(self.slots.decoding), self.slots.available()
        while group := self._admissible(slots, available, self.waiting.index(batch[-1]) + 1 if batch else 0):
            size = len(group.request.prompt_ids) - self._cached_tokens(group)
            if size > budget or group.request.prompt_embeds is not None:
                break
            batch.append(group)
            budget -= size
            slots += group.params.width
            available -= self._claim(group)
        for group in batch:
            self._take(group)
            self._admit(group)
        return batch

    def requeue(self, groups: list[SequenceGroup]) -> None:
        """Back to the front of the queue (a single short prompt takes the chunked path)."""
        for group in reversed(groups):
            self.waiting.appendleft(group)

    def start_prefill(self, slot: int, available: int) -> SequenceGroup | None:
        """The request whose prompt is being prefilled: the one in progress, else the next waiting one that fits
        in `available` blocks (admitted now and seated in `slot`, its cached prefix loaded); None when nothing can
        start (no room; a preempted candidate being recomputed, or one whose turn it is: _preempted_turn)."""
        if self.slots.prefilling is None:
            if self._preempted_turn():
                return None
            group = self._admissible(slot, available)
            if group is None:
                return None  # wait for slots / KV budget to free up
            self._take(group)
            self._admit(group)
            self.slots.prefilling = group
            self.slots.seat(self.new_parent(group), slot)
            self.load_cached_prefix(group)
        if isinstance(self.slots.prefilling, Recompute):
            return None
        return self.slots.prefilling

    # -- prefix cache --------------------------------------------------------------------------

    def _cached_blocks(self, group: SequenceGroup, touch: bool = False) -> list[int]:
        """The pool blocks of the prompt's cached prefix (`touch=False`: a peek, nothing counted or moved)."""
        if self.prefix_cache is None:
            return []
        if group.prefix_chain is None:
            group.prefix_chain = self.prefix_cache.prompt_chain(group.request.prompt_ids, salt_of(group))
        return self.prefix_cache.lookup(group.request.prompt_ids, None, touch, chain=group.prefix_chain)

    def _cached_tokens(self, group: SequenceGroup) -> int:
        """How much of the prompt the prefix cache holds now (a peek: nothing counted or moved)."""
        return len(self._cached_blocks(group)) * BLOCK_TOKENS

    def load_cached_prefix(self, group: SequenceGroup) -> None:
        """The parent (already seated) starts with the prompt's cached blocks, held, not copied; only the rest is
        prefilled."""
        if self.prefix_cache is None:
            return
        parent = group.sequences[0]
        held = self._cached_blocks(group, touch=True)
        self.slots.share(parent, held)
        group.prefilled = parent.kv_len = group.cached_tokens = len(held) * BLOCK_TOKENS
        self.stats.prefix_hits += group.cached_tokens

    def cache_prompt(self, group: SequenceGroup) -> None:
        if self.prefix_cache is not None:
            parent = group.sequences[0]
            self.prefix_cache.store(group.request.prompt_ids, salt_of(group), parent.blocks, parent.kv_len)

    def cache_finished(self, seq: Sequence) -> None:
        """Key a finished candidate's prompt + output blocks (a chat's next turn starts with both). Its row is
        retired right after: the blocks stay cached, idle, until the pool needs the room."""
        if self.prefix_cache is not None and seq.finish_reason in ("stop", "length"):
            self.prefix_cache.store(seq.prompt_ids + seq.output_ids, salt_of(seq.group), seq.blocks,
                                    seq.kv_len)

    def place(self, group: SequenceGroup) -> list[Sequence]:
        """Fork the prefilled parent into its n/best_of candidates and append them to the decode rows."""
        parent = group.sequences[0]
        children = [parent.fork(i, candidate_generator(group.params.seed, i), self.tokenizer)
                    for i in range(1, group.params.width)]
        rows = self.slots.place(group, children)
        group.first_token_at = time.monotonic()
        self.stats.observe("time_to_first_token", group.first_token_at - group.request.arrival)
        self.stats.observe("request_prefill_time", group.first_token_at - (group.admitted_at or group.request.arrival))
        return rows

    def retire(self, seq: Sequence) -> None:
        if self.slots.retire(seq):
            self.counts.release(seq)  # its penalty-count row, now (not when the cyclic GC runs)
