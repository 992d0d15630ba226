"""Preemption by recompute, as vLLM v1 does it: when a decode step's rows need more KV blocks than are left, the
newest running candidate (or the prefill in progress, when it is newer) gives its blocks back and waits. Preempted
candidates come back, oldest first, with the room and prefill budget that new requests leave, by prefilling their
prompt and every token they streamed but the last again (what the prefix cache still holds of it is taken back,
not prefilled). New requests go first because their first token is what a client waits on (the gateway's
first-chunk timeout) while a preempted stream has already started, but each preempted candidate is passed over at
most BYPASS_LIMIT times (`_preempted_turn`). A candidate keeps its generator, grammar state, detokenizer and
streamed text while it waits, so with our CPU kernels (a prefill computes the K/V bits the decode steps did) its
tokens are the ones it would have had.

The scheduler's part that decides who gives way; engine.core.scheduler mixes it in.
"""

from __future__ import annotations

import collections
from collections.abc import Callable

from engine.core.prefix_cache import PrefixCache, salt_of
from engine.core.sequence import Sequence, SequenceGroup
from engine.core.slots import BLOCK_TOKENS, Recompute, SlotTable, blocks, owner
from engine.core.stats import EngineStats
from engine.request import RequestOutput

BYPASS_LIMIT = 64  # how many later requests may start before a waiting or preempted one
# a streamed request whose candidates wait preempted sends an empty output this often: it is alive, so the
# gateway's inter-chunk timeout (60 s by default) does not cut a stream that is only waiting for KV room
PREEMPTED_HEARTBEAT_S = 10.0


class Preemption:
    # the scheduler's state this part reads and changes
    slots: SlotTable
    waiting: collections.deque[SequenceGroup]
    preempted: list[Sequence]  # candidates waiting to be recomputed (first when they fit)
    prefix_cache: PrefixCache | None
    stats: EngineStats
    clock: Callable[[], float]

    def retire(self, seq: Sequence) -> None:
        raise NotImplementedError

    def _preempted_turn(self) -> bool:
        """Whether new requests must wait for the preempted candidates: a new request whose prompt fits starts
        before them (its first token should not wait for someone else's long answer), but each preempted candidate
        is passed over at most BYPASS_LIMIT times, so it is never starved."""
        return any(seq.bypassed >= BYPASS_LIMIT for seq in self.preempted)

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

    def _keep_cached(self, seq: Sequence, tokens: list[int]) -> None:
        """Key the full blocks a preempted candidate has written (`tokens` at its positions) before it gives them
        back. Idle, they are reused last (least recently used first, each chain's tail before its root), so
        when the candidate comes back its recompute takes most of its own K/V back instead of prefilling it again,
        as vLLM v1 frees a preempted request's blocks. They hold the bits its decode steps wrote, which are the
        bits a prefill would write (engine.core.slots)."""
        if self.prefix_cache is not None and seq.blocks:
            self.prefix_cache.store(tokens, salt_of(seq.group), seq.blocks, seq.kv_len)

    def _preempt(self, seq: Sequence) -> None:
        self._keep_cached(seq, seq.prompt_ids + seq.output_ids)
        self.retire(seq)
        seq.slot, seq.kv_len, seq.bypassed = -1, 0, 0
        self.preempted.append(seq)

    def _preempt_prefill(self, job: SequenceGroup | Recompute) -> None:
        if isinstance(job, Recompute):
            self._keep_cached(job.seq, job.tokens)
        elif job.sequences:
            self._keep_cached(job.sequences[0], job.request.prompt_ids)
        self.slots.drop_prefill(owner(job))
        if isinstance(job, Recompute):
            job.seq.slot, job.seq.kv_len, job.seq.bypassed = -1, 0, 0
            self.preempted.append(job.seq)
            return
        job.prefilled, job.cached_tokens, job.sequences = 0, 0, []  # its prompt runs again from the start
        self.waiting.appendleft(job)

    def start_recompute(self, slot: int, available: int) -> Recompute | None:
        """The preempted candidate being recomputed: the one in progress, else the oldest waiting one if its
        blocks fit in `available` (seated in `slot`, from its cached prefix if the prefix cache holds one)."""
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
            cached = self.prefix_cache.lookup(tokens, salt_of(seq.group), touch=False)
            need -= sum(1 for b in cached if self.slots.pool.refs[b])
        if not self.slots.fits(need, 1, slot, available):
            return None
        self.preempted.remove(seq)
        job = Recompute(seq)
        self.slots.prefilling = job
        self.slots.seat(seq, slot)
        self.slots.share(seq, cached)
        job.prefilled = seq.kv_len = len(cached) * BLOCK_TOKENS
        return job
