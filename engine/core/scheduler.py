"""Admission and the step's prefill plan: which waiting requests run, in which KV slots, and their ending.

It admits requests (validation, then room for their prompts' KV blocks), hands the engine core the whole short
prompts for one batched prefill or the next chunk of one long prompt, preempts the newest running candidates when
the running rows' blocks would pass the KV budget and brings them back by recomputing their K/V, aborts requests
(cancelled, failed), places prefilled candidates and retires finished ones through the slot table
(engine.core.slots, which states the slot invariant and how blocks are counted), and keys the prefix cache. It
never runs a forward or samples: that is engine.core.engine_core's step.

Preemption follows vLLM v1: by recompute, newest first, the preempted brought back first whenever they fit (a new
request that fits may start while they do not, a bounded number of times: _preempted_turn). A candidate keeps its
generator, grammar state, detokenizer and streamed text while it waits; its prompt and tokens are prefilled again
and it decodes on from its last token. With our CPU kernels a prefill computes the same K/V bits as the decode
steps did (README, engine guarantees), so a preempted request's tokens are the ones it would have had.
"""

from __future__ import annotations

import collections
import hashlib
import itertools
import logging
import time
from collections.abc import Callable, Iterator
from typing import Any

from engine.core import kv_events
from engine.core.prefix_cache import PrefixCache
from engine.core.sequence import Sequence, SequenceGroup, candidate_generator
from engine.core.slots import BLOCK_TOKENS, Recompute, SlotTable, blocks, owner
from engine.core.stats import EngineStats
from engine.errors import EngineError
from engine.request import EngineRequest, RequestOutput
from engine.runner.model_runner import ModelRunner
from engine.sampling.penalty_counts import PenaltyCounts

log = logging.getLogger(__name__)

BYPASS_LIMIT = 64  # how many later requests may start before a waiting one that does not fit yet
# a streamed request whose candidates wait preempted sends an empty output this often: it is alive, so the
# gateway's inter-chunk timeout (60 s by default) does not cut a stream that is only waiting for KV room
PREEMPTED_HEARTBEAT_S = 10.0


class Scheduler:
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
        self._check_kv_room(group)
        self.waiting.append(group)

    def _check_kv_room(self, group: SequenceGroup) -> None:
        """Refuse only what could never run on this engine even alone: its prompts (one per candidate) with room
        to grow, or one candidate at its longest. Anything smaller runs, preempted and recomputed if need be."""
        params, budget = group.params, self.slots.budget_blocks
        longest = min(len(group.request.prompt_ids) + params.max_tokens, self.max_len)
        if blocks(longest) + 1 > budget:
            raise EngineError(
                "invalid_request",
                f"the prompt plus '{params.max_tokens_param}' ({longest} token positions) exceeds this engine's KV "
                f"memory of {self.kv_budget} token positions",
                params.max_tokens_param,
            )
        if blocks(len(group.request.prompt_ids) + 1) + 2 * params.width - 1 > budget:
            raise EngineError(
                "invalid_request",
                f"n/best_of ({params.width}) copies of a {len(group.request.prompt_ids)}-token prompt exceed this "
                f"engine's KV memory of {self.kv_budget} token positions; lower n/best_of or shorten the prompt",
                "best_of" if params.best_of else "n",
            )

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

    def _preempted_turn(self) -> bool:
        """Whether new requests must wait for the preempted candidates. A preempted candidate is brought back
        first whenever its blocks fit; while they do not, a new request whose prompt fits may start (its first
        token should not wait for someone else's long answer), but each preempted candidate is passed over at most
        BYPASS_LIMIT times, so it is never starved."""
        return any(seq.bypassed >= BYPASS_LIMIT for seq in self.preempted)

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

    def start_prefill(self) -> SequenceGroup | None:
        """The request whose prompt is being prefilled: the one in progress, else the next waiting one if it
        fits (admitted now, its cached prefix loaded into its slot); None when nothing can start (no room; a
        preempted candidate being recomputed, or one whose turn it is: _preempted_turn)."""
        if self.slots.prefilling is None:
            if self._preempted_turn():
                return None
            group = self._admissible(len(self.slots.decoding), self.slots.available())
            if group is None:
                return None  # wait for slots / KV budget to free up
            self._take(group)
            self._admit(group)
            self.slots.prefilling = group
            self.slots.seat(self.new_parent(group), len(self.slots.decoding))
            self.load_cached_prefix(group)
        if isinstance(self.slots.prefilling, Recompute):
            return None
        return self.slots.prefilling

    # -- prefix cache --------------------------------------------------------------------------

    @staticmethod
    def _cache_salt(group: SequenceGroup) -> object:
        """What the K/V depends on besides the token ids: the adapter and the image inputs; and whose it is: the
        request's tenant salt, so one tenant's prompts never hit (nor time) another's blocks."""
        if group.cache_salt is None:
            embeds = group.request.prompt_embeds
            digest = None
            if embeds is not None:
                digest = hashlib.blake2b(embeds.detach().float().cpu().numpy().tobytes(), digest_size=16).hexdigest()
            group.cache_salt = (group.params.lora_adapter, digest, group.request.cache_salt)
        return group.cache_salt

    def _cached_blocks(self, group: SequenceGroup, touch: bool = False) -> list[int]:
        """The pool blocks of the prompt's cached prefix (`touch=False`: a peek, nothing counted or moved)."""
        if self.prefix_cache is None:
            return []
        if group.prefix_chain is None:
            group.prefix_chain = self.prefix_cache.prompt_chain(group.request.prompt_ids, self._cache_salt(group))
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
            self.prefix_cache.store(group.request.prompt_ids, self._cache_salt(group), parent.blocks, parent.kv_len)

    def cache_finished(self, seq: Sequence) -> None:
        """Key a finished candidate's prompt + output blocks (a chat's next turn starts with both). Its row is
        retired right after: the blocks stay cached, idle, until the pool needs the room."""
        if self.prefix_cache is not None and seq.finish_reason in ("stop", "length"):
            self.prefix_cache.store(seq.prompt_ids + seq.output_ids, self._cache_salt(seq.group), seq.blocks,
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

    # -- preemption ----------------------------------------------------------------------------

    def make_room(self) -> None:
        """Every decoding row writes one more position this step. While the blocks that takes are more than are
        left, the newest running candidate (or the prefill in progress, when it is newer) gives its blocks back and
        waits at the front to be recomputed. Then each row's next position gets its block."""
        while self.slots.decode_need() > self.slots.available():
            newest = max(self.slots.decoding, key=self._age, default=None)
            job = self.slots.prefilling
            if job is not None and (newest is None or self._job_age(job) > self._age(newest)):
                self._preempt_prefill(job)
            elif newest is not None:
                self._preempt(newest)
            else:
                break
            self.stats.preemptions += 1
        self.slots.grow_decoding()

    def _heartbeat_preempted(self) -> None:
        """An empty output for each streamed request whose candidates all wait (preempted or being recomputed)
        and that has sent nothing for PREEMPTED_HEARTBEAT_S: the client's stream only pauses."""
        waiting = [seq.group for seq in self.preempted]
        if isinstance(self.slots.prefilling, Recompute):
            waiting.append(self.slots.prefilling.group)
        if not waiting:
            return
        now = self.clock()
        for group in {id(g): g for g in waiting}.values():
            last = group.last_output_at
            if group.request.stream and not group.sent_final and last is not None \
                    and now - last >= PREEMPTED_HEARTBEAT_S:
                group.emit(RequestOutput("", 0, "", progress=True))

    @staticmethod
    def _age(seq: Sequence) -> tuple[int, int]:
        """(admission, candidate): larger is newer."""
        return (seq.group.admission, seq.index)

    @staticmethod
    def _job_age(job: SequenceGroup | Recompute) -> tuple[int, int]:
        return (job.group.admission, job.seq.index) if isinstance(job, Recompute) else (job.admission, -1)

    def _preempt(self, seq: Sequence) -> None:
        self.retire(seq)
        seq.slot, seq.kv_len, seq.bypassed = -1, 0, 0
        self.preempted.append(seq)

    def _preempt_prefill(self, job: SequenceGroup | Recompute) -> None:
        self.slots.drop_prefill(owner(job))
        if isinstance(job, Recompute):
            job.seq.slot, job.seq.kv_len, job.seq.bypassed = -1, 0, 0
            self.preempted.append(job.seq)
            return
        job.prefilled, job.cached_tokens, job.sequences = 0, 0, []  # its prompt runs again from the start
        self.waiting.appendleft(job)

    def start_recompute(self) -> Recompute | None:
        """The preempted candidate being recomputed: the one in progress, else the oldest waiting one if its
        blocks fit now (in slot B, from its cached prefix if the prefix cache holds one)."""
        job = self.slots.prefilling
        if isinstance(job, Recompute):
            return job  # at slot B (a retiring row moves it down: SlotTable.retire)
        if job is not None or not self.preempted:
            return None
        seq = min(self.preempted, key=self._age)
        tokens = seq.prompt_ids + seq.output_ids[:-1]
        need = blocks(len(tokens) + 1)  # its tokens but the last, and the position the last is written at
        cached: list[int] = []
        if self.prefix_cache is not None:
            cached = self.prefix_cache.lookup(tokens, self._cache_salt(seq.group), touch=False)
            need -= sum(1 for b in cached if self.slots.pool.refs[b])
        if not self.slots.fits(need, 1, len(self.slots.decoding), self.slots.available()):
            return None
        self.preempted.remove(seq)
        job = Recompute(seq)
        self.slots.prefilling = job
        self.slots.seat(seq, len(self.slots.decoding))
        self.slots.share(seq, cached)
        job.prefilled = seq.kv_len = len(cached) * BLOCK_TOKENS
        return job
