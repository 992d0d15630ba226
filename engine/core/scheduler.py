"""The scheduler: which sequences compute which tokens in the next step, and the requests' lifecycle.

One number per sequence says where it stands, as in vLLM v1: its computed tokens (`Sequence.num_computed`). Each
step has one token budget, decode rows included (vLLM's `max_num_batched_tokens`). `schedule()` gives every running
sequence its next tokens in the waiting policy's rank order (engine.core.waiting_queue; arrival under fcfs): a
decode row its last token, a prompt its next chunk, each with its KV room from one call (engine.core.kv_manager
`allocate`). When the blocks run out the last in that order is preempted: its blocks are freed and stay keyed in the
prefix cache, its count goes back to 0, and it waits (behind new requests, engine.core.waiting_queue). Then,
unless the blocks ran short, waiting sequences are admitted from the head of the queue while the budget, the rows
and the blocks last, each from its cached prefix. A preempted candidate comes back as a prompt does: its prompt and
every token it has streamed are its tokens, mostly cached, and its last span samples its next token. It keeps its
generator, grammar state and detokenizer, and under our kernels a prefill computes the bits the decode steps did:
the same tokens, none twice.

`complete()` runs after the forward: the counts move on and a finished prompt forks its n/best_of candidates.
"""

from __future__ import annotations

import itertools
import logging
import time
from collections.abc import Callable
from typing import Any

from engine.core import kv_events
from engine.core.admission import check_kv_room, check_request
from engine.core.fair_share import FairQueue
from engine.core.invariants import check_invariants
from engine.core.kv_manager import BLOCK_TOKENS, KVManager
from engine.core.output_processor import send_heartbeats
from engine.core.sequence import Sequence, SequenceGroup, candidate_generator
from engine.core.stats import EngineStats
from engine.core.step_plan import PlannedSpan, StepBuilder, StepPlan
from engine.core.waiting_queue import FcfsQueue, PriorityQueue, WaitingPolicy
from engine.errors import EngineError
from engine.request import EngineRequest
from engine.runner.model_runner import ModelRunner
from engine.sampling.penalty_counts import PenaltyCounts

log = logging.getLogger(__name__)

POLICIES: dict[str, type[WaitingPolicy]] = {"fcfs": FcfsQueue, "priority": PriorityQueue, "fair": FairQueue}


def _seats(seq: Sequence) -> int:
    """Batch rows the sequence will hold: a new prompt's every n/best_of candidate, forked once it is computed."""
    return 1 if seq.group.forked else seq.group.params.width


class Scheduler:
    def __init__(self, runner: ModelRunner, counts: PenaltyCounts, tokenizer, max_num_batched_tokens: int = 1024,
                 kv_budget_tokens: int | None = None, prefix_cache_tokens: int = 0, reasoning: bool = False,
                 publish_kv_events: Callable[[list[dict[str, Any]]], None] | None = None,
                 max_partial_prefills: int = 1, check_invariants: bool = False,
                 scheduling_policy: str = "fcfs") -> None:
        """`counts`: the sampler's penalty counts (a retired row's is freed at once); `reasoning`: the model
        thinks in <think>...</think> (its profile says so); `max_partial_prefills`: prompts chunked at once (more
        than one caps each prompt's chunk at its share of the budget, so short prompts start beside a long one);
        `check_invariants`: check the requests' states and the pool's accounting after every step;
        `scheduling_policy`: `fcfs`, `priority` or `fair` (engine.core.waiting_queue)."""
        self.runner = runner
        self.counts = counts
        self.tokenizer = tokenizer
        self.max_slots, self.max_len = runner.cache.slots, runner.cache.max_len
        if max_num_batched_tokens < self.max_slots:  # every decode row must fit in one step's budget
            raise ValueError(f"max_num_batched_tokens ({max_num_batched_tokens}) is below max_slots "
                             f"({self.max_slots})")
        self.token_budget = max_num_batched_tokens
        self.max_partial_prefills = max_partial_prefills
        self.kv = KVManager(runner.cache, kv_budget_tokens, prefix_cache_tokens)
        self.kv_budget = self.kv.budget_tokens
        self.prefix_cache = self.kv.prefix_cache
        self.waiting: WaitingPolicy = POLICIES[scheduling_policy]()
        self.running: list[Sequence] = []
        self.requests: dict[int, SequenceGroup] = {}  # every request not yet ended
        self.clock = time.monotonic  # injectable (tests)
        self._admissions = itertools.count()
        self._arrivals = itertools.count()
        self.stats = EngineStats(kv_budget=self.kv.total_blocks)
        self.check_invariants = check_invariants
        self.reasoning = reasoning
        # KV events (engine.core.kv_events): the prefix cache records its stored and evicted blocks, sent each step
        self.publish_kv_events = publish_kv_events if self.prefix_cache is not None else None
        if self.publish_kv_events is not None and self.prefix_cache is not None:
            self.prefix_cache.events = []
            self.publish_kv_events([kv_events.all_blocks_cleared()])  # a new process holds no block yet

    # -- requests ------------------------------------------------------------------------------

    def add(self, request: EngineRequest) -> None:
        """Validate a request (engine.core.admission) and queue its first candidate."""
        check_request(request, self.max_len, self.max_slots, self.runner.adapters)
        group = SequenceGroup(request)
        if self.reasoning:
            group.reasoning = True
            group.thinking_open = self.tokenizer.decode(request.prompt_ids[-8:]).rstrip().endswith("<think>")
        check_kv_room(group, self.kv.total_blocks, self.kv_budget, self.max_len)
        parent = Sequence(group, 0, candidate_generator(group.params.seed, 0), self.tokenizer)
        if request.grammar is not None:
            parent.grammar = request.grammar()
        group.sequences = [parent]
        group.order = next(self._arrivals)
        self.requests[id(group)] = group
        self.waiting.add(parent)

    @property
    def queue_depth(self) -> int:
        """Requests waiting: not yet admitted, or preempted (as vLLM counts them)."""
        return len({id(seq.group) for seq in self.waiting})

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def groups_in_flight(self) -> list[SequenceGroup]:
        """Every request the scheduler holds, once each: waiting, running or preempted."""
        return [group for group in list(self.requests.values()) if not group.sent_final]

    def reap_cancelled(self) -> None:
        for group in self.groups_in_flight():
            check = group.request.is_cancelled
            if check is not None and check():
                self.abort(group, "cancelled")

    def abort(self, group: SequenceGroup, reason: str, error: EngineError | None = None) -> None:
        """Drop a request wherever it is, free its blocks, and end it with one final output."""
        for seq in group.sequences:
            if seq in self.waiting:
                self.waiting.remove(seq)
            self.retire(seq)
        if self.requests.pop(id(group), None) is not None:
            self.waiting.done(group)
        if reason == "cancelled":
            self.stats.cancelled += 1
        if not group.sent_final:
            self.stats.finish(reason)
            group.end_early(reason, error)

    def fail(self, failures: dict[int, tuple[SequenceGroup, EngineError]]) -> None:
        for group, error in failures.values():
            log.warning("request %s failed: %s", group.request.request_id, error.message)
            self.abort(group, "error", error)

    def retire(self, seq: Sequence) -> None:
        """A candidate leaves the running batch (finished, or its request ended): its blocks go back."""
        if seq in self.running:
            self.running.remove(seq)
        self.kv.free(seq)
        self.counts.release(seq)  # its penalty-count row, now (not when the cyclic GC runs)

    # -- the plan ------------------------------------------------------------------------------

    def schedule(self) -> StepPlan:
        self.reap_cancelled()
        preemptions = self.stats.preemptions
        self.running.sort(key=self.waiting.rank)  # the last gives way first
        self._preempt_for_rank()
        step = StepBuilder(self.token_budget)
        before = self.stats.preemptions_by_cause["kv"]
        self._schedule_running(step)
        if self.stats.preemptions_by_cause["kv"] == before:  # as vLLM: nothing starts in a step short of blocks
            self._schedule_waiting(step)
        plan = step.plan(self.kv)
        plan.preempted = self.stats.preemptions - preemptions
        return plan

    def _span_end(self, seq: Sequence, start: int, step: StepBuilder) -> int | None:
        """Where the sequence's next span ends, from position `start`, within the step's budget; None when it
        would be one prompt chunked too many."""
        remaining = seq.num_tokens - start
        count = min(remaining, step.budget)
        if self.max_partial_prefills > 1 and remaining > 1:  # vLLM's long_prefill_token_threshold
            count = min(count, max(1, self.token_budget // self.max_partial_prefills))
        end = start + count
        prompt = len(seq.prompt_ids)
        if seq.group.request.prompt_embeds is not None and start < prompt:
            end = min(end, prompt)  # an image request's embeddings span its prompt only
        if end < seq.num_tokens and step.partial >= self.max_partial_prefills:
            return None
        return end

    def _fork_reserve(self, seq: Sequence, end: int) -> int:
        """Blocks a span ending a new prompt sets aside: a copy of its partly filled last block for each n/best_of
        candidate after the first (engine.core.kv_manager `fork`)."""
        if seq.group.forked or end < seq.num_tokens or end % BLOCK_TOKENS == 0:
            return 0
        return seq.group.params.width - 1

    def _preempt_for_rank(self) -> None:
        """A waiting request that outranks the last running one (engine.core.waiting_queue: a better priority, or a
        tenant with less service) takes its place when there is no room for it: no batch row, or too few blocks
        for its first span."""
        while (seq := self.waiting.peek()) is not None and (victim := self.waiting.victim(self.running)) is not None:
            if not self.waiting.outranks(seq, victim, self.running) or self._room_for(seq):
                return
            self._preempt(victim, "priority")

    def _room_for(self, seq: Sequence) -> bool:
        """Whether the waiting sequence could be admitted now: a batch row for each of its candidates, and the
        blocks of its first span (within what the decode rows leave of the budget) beside the watermark."""
        if sum(map(_seats, self.running)) + _seats(seq) > self.max_slots:
            return False
        hits = self.kv.cached_prefix(seq)
        start = len(hits) * BLOCK_TOKENS
        end = min(seq.num_tokens, start + max(1, self.token_budget - len(self.running)))
        return self.kv.fits(seq, end, hits, self._fork_reserve(seq, end), self.kv.watermark)

    def _schedule_running(self, step: StepBuilder) -> None:
        """Every running sequence's next tokens, in rank order; while the blocks run out, the last gives way."""
        index = 0
        while index < len(self.running) and step.budget > 0:
            seq = self.running[index]
            end = self._span_end(seq, seq.num_computed, step)
            if end is None:
                index += 1
                continue
            while not self.kv.allocate(seq, end, reserve=self._fork_reserve(seq, end)):
                victim = self.running[-1]  # not yet scheduled: the running are in rank order
                self._preempt(victim, "kv")
                if victim is seq:
                    return
            step.add(seq, end)
            index += 1

    def _schedule_waiting(self, step: StepBuilder) -> None:
        """Waiting sequences from the head of the queue, each from its cached prefix, while the budget, the rows
        and the blocks last; a watermark of blocks stays free for the running rows' next steps."""
        seats = sum(map(_seats, self.running))
        while step.budget > 0 and (seq := self.waiting.peek()) is not None:
            if seats + _seats(seq) > self.max_slots:
                return
            hits = self.kv.cached_prefix(seq)
            start = len(hits) * BLOCK_TOKENS
            end = self._span_end(seq, start, step)
            if end is None:
                return
            headroom = self.kv.watermark + step.growth if self.running else 0
            if not self.kv.allocate(seq, end, hits, self._fork_reserve(seq, end), headroom):
                return
            self.waiting.pop()
            self._admit(seq, start)
            self.running.append(seq)
            step.add(seq, end)
            seats += _seats(seq)

    def _admit(self, seq: Sequence, cached: int) -> None:
        group = seq.group
        if group.admission < 0:
            group.admission = next(self._admissions)
            group.admitted_at = time.monotonic()
            group.cached_tokens = cached
            self.stats.observe("request_queue_time", group.admitted_at - group.request.arrival)
            self.stats.prompt_tokens += len(group.request.prompt_ids)
            self.waiting.charge(seq, len(group.request.prompt_ids) - cached, 0)
        if self.prefix_cache is not None:  # every lookup counts, a preempted candidate's return included
            self.stats.prefix_queries += seq.num_tokens
            self.stats.prefix_hits += cached
        seq.num_computed = cached

    def _preempt(self, seq: Sequence, cause: str) -> None:
        """The sequence gives its blocks back (what it wrote stays keyed in the prefix cache, for its return) and
        waits in the queue (engine.core.waiting_queue says where), to be computed again from its first token.
        `cause`: `kv` (the blocks ran out) or `priority` (a waiting request outranked it)."""
        self.kv.keep(seq, seq.num_computed)
        self.retire(seq)
        seq.num_computed = 0
        self.waiting.add_preempted(seq)
        self.stats.preemptions += 1
        self.stats.preemptions_by_cause[cause] += 1

    # -- after the forward ---------------------------------------------------------------------

    def complete(self, decoded: list[Sequence], spans: list[PlannedSpan]) -> tuple[list[Sequence], list[int]]:
        """The rows and spans whose forward ran hold their K/V now: their computed counts move on, and a span
        that ends a new prompt forks its n/best_of candidates. Returns the rows that sample from the spans' logits,
        in span order, and how many rows each sampling span feeds."""
        for seq in decoded:
            seq.num_computed += 1
            self.waiting.charge(seq, 0, 1)
        rows: list[Sequence] = []
        widths: list[int] = []
        for span in spans:
            seq = span.seq
            seq.num_computed = span.end
            if not span.sample:
                continue
            group = seq.group
            if not group.forked:
                self._fork(group)
                rows += group.sequences
                widths.append(len(group.sequences))
            else:
                rows.append(seq)
                widths.append(1)
        for seq in rows:
            self.waiting.charge(seq, 0, 1)
        return rows, widths

    def _fork(self, group: SequenceGroup) -> None:
        parent = group.sequences[0]
        for index in range(1, group.params.width):
            child = parent.fork(index, candidate_generator(group.params.seed, index), self.tokenizer)
            self.kv.fork(parent, child)
            group.sequences.append(child)
            self.running.append(child)
        group.forked = True
        group.first_token_at = time.monotonic()
        self.stats.observe("time_to_first_token", group.first_token_at - group.request.arrival)
        self.stats.observe("request_prefill_time", group.first_token_at - (group.admitted_at or group.request.arrival))

    def cache_prompt(self, group: SequenceGroup) -> None:
        """Key a new request's prompt blocks once its first token is out: later prompts that start the same way
        hold them."""
        parent = group.sequences[0]
        self.kv.keep(parent, len(parent.prompt_ids))

    def cache_finished(self, seq: Sequence) -> None:
        """Key a finished candidate's prompt + output blocks (a chat's next turn starts with both). Its row is
        retired right after: the blocks stay cached, idle, until the pool needs the room."""
        if seq.finish_reason in ("stop", "length"):
            self.kv.keep(seq, seq.num_computed)

    def end_step(self) -> None:
        self.stats.running = len({id(seq.group) for seq in self.running})
        self.stats.kv_used = self.kv.pool.used
        send_heartbeats(itertools.chain(self.waiting, self.running), self.clock())
        if self.publish_kv_events is not None and self.prefix_cache is not None and self.prefix_cache.events:
            self.publish_kv_events(self.prefix_cache.events)
            self.prefix_cache.events = []
        for key, group in list(self.requests.items()):
            if group.sent_final:
                del self.requests[key]
                self.waiting.done(group)
        self.stats.count_bands(self.running, self.waiting)
        if self.check_invariants:
            check_invariants(self.running, self.waiting, self.requests, self.kv)
