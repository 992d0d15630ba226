"""Scheduler and engine behaviour with the real SmolLM2 model (loaded once per session, see conftest.py).

Most tests drive an EngineCore synchronously (one `step()` at a time, on its own KV cache) so that batch
composition is deterministic; the join/leave and queue tests go through the threaded LLMEngine.
"""

from __future__ import annotations

import queue
import threading

import pytest
import torch

from engine.errors import QueueFull
from engine.request import EngineRequest, RequestOutput
from engine.sampling_params import SamplingParams
from tests.helpers.waiting import poll

from .conftest import ENGINE_SLOTS
from .engine_run import PROMPTS, Run, greedy


@pytest.fixture(scope="module")
def prompts(real_engine) -> list[list[int]]:
    return [real_engine.encode_prompt(messages=[{"role": "user", "content": p}]) for p in PROMPTS]


# -- seeded sampling ------------------------------------------------------------------------------


def test_seeded_request_same_tokens_alone_and_in_batch_of_3(make_scheduler, prompts):
    def params() -> SamplingParams:
        return SamplingParams(temperature=1.0, seed=1234, max_tokens=16, ignore_eos=True)
    alone = Run(make_scheduler())
    alone.add("a", prompts[0], params())
    alone.until_done()

    batch = Run(make_scheduler())
    batch.add("x", prompts[1], SamplingParams(temperature=1.0, seed=7, max_tokens=20, ignore_eos=True))
    batch.add("a", prompts[0], params())
    batch.add("y", prompts[2], SamplingParams(temperature=0.8, top_p=0.9, max_tokens=8, ignore_eos=True))
    batch.step()
    assert len(batch.sched.scheduler.running) == 3  # really one batch of three
    batch.until_done()

    assert batch.tokens[("a", 0)] == alone.tokens[("a", 0)]
    assert len(alone.tokens[("a", 0)]) == 16

    # and joining a batch that is already mid-flight changes nothing either
    late = Run(make_scheduler())
    late.add("x", prompts[1], SamplingParams(temperature=1.0, seed=7, max_tokens=20, ignore_eos=True))
    for _ in range(5):
        late.step()
    late.add("a", prompts[0], params())
    late.until_done()
    assert late.tokens[("a", 0)] == alone.tokens[("a", 0)]


def test_unseeded_requests_differ(make_scheduler, prompts):
    run = Run(make_scheduler())
    for rid in ("u1", "u2"):
        run.add(rid, prompts[0], SamplingParams(temperature=1.0, max_tokens=8, ignore_eos=True))
    run.until_done()
    assert run.tokens[("u1", 0)] != run.tokens[("u2", 0)]


# -- greedy matches HF ------------------------------------------------------------------------------


@torch.inference_mode()
def test_greedy_matches_hf_generate_first_tokens_and_logprobs(real_engine, make_scheduler, prompts):
    run = Run(make_scheduler())
    for i, p in enumerate(prompts[:3]):  # batched: three rows of different lengths share the decode steps
        run.add(f"g{i}", p, greedy(8, logprobs=True, ignore_eos=True))
    run.until_done()
    for i, p in enumerate(prompts[:3]):
        ref = real_engine.model.generate(
            torch.tensor([p]),
            attention_mask=torch.ones(1, len(p), dtype=torch.long),
            max_new_tokens=8,
            min_new_tokens=8,
            do_sample=False,
            output_logits=True,
            return_dict_in_generate=True,
        )
        ref_tokens = ref.sequences[0, len(p) :].tolist()
        assert run.tokens[(f"g{i}", 0)] == ref_tokens
        ref_lp = [torch.log_softmax(step[0].float(), -1)[t].item()
                  for step, t in zip(ref.logits, ref_tokens, strict=False)]
        got_lp = [e["logprob"] for o in run.outputs[f"g{i}"] for e in (o.logprobs or [])]
        assert got_lp == pytest.approx(ref_lp, abs=2e-3)


# -- join / leave / cancel ----------------------------------------------------------------------------


def _drain(q: queue.Queue[RequestOutput], timeout: float = 60.0) -> list[RequestOutput]:
    outs = []
    while True:
        out = q.get(timeout=timeout)
        outs.append(out)
        if out.final:
            return outs


def test_join_and_leave_mid_flight(real_engine, prompts):
    ref_long = _drain(real_engine.generate("ref-long", prompts[0], greedy(24, ignore_eos=True)))
    ref_short = _drain(real_engine.generate("ref-short", prompts[1], greedy(8, ignore_eos=True)))

    q_long = real_engine.generate("long", prompts[0], greedy(24, ignore_eos=True))
    first = q_long.get(timeout=60)  # the long request is decoding now
    assert not first.final
    q_short = real_engine.generate("short", prompts[1], greedy(8, ignore_eos=True))
    short = _drain(q_short)
    long = [first, *_drain(q_long)]

    # the short one joined and left while the long one kept decoding
    assert short[-1].finish_reason == "length" and short[-1].completion_tokens == 8
    assert long[-1].finish_reason == "length" and long[-1].completion_tokens == 24
    assert "".join(o.text for o in short) == "".join(o.text for o in ref_short)
    assert "".join(o.text for o in long) == "".join(o.text for o in ref_long)
    poll(real_engine.core.scheduler.has_work, 5, until=lambda busy: not busy, interval_s=0.01)
    assert not real_engine.core.scheduler.running


def test_cancellation_frees_the_slot_within_one_step(make_scheduler, prompts):
    ref = Run(make_scheduler())
    ref.add("keep", prompts[1], greedy(20, ignore_eos=True))
    ref.until_done()

    run = Run(make_scheduler())
    cancelled = threading.Event()
    run.add("victim", prompts[0], greedy(100, ignore_eos=True), is_cancelled=cancelled.is_set)
    run.add("keep", prompts[1], greedy(20, ignore_eos=True))
    for _ in range(3):
        run.step()
    victim = run.groups["victim"]
    assert run.sched.scheduler.running[0].group is victim  # batch row 0: after it the other row moves down

    cancelled.set()
    run.step()
    (keep,) = run.sched.scheduler.running
    assert keep.group is not victim and keep.slot == 0
    finals = run.finals("victim")
    assert len(finals) == 1 and finals[0].finish_reason == "cancelled"
    assert run.outputs["victim"][-1] is finals[0]
    assert run.sched.stats.cancelled == 1

    run.until_done()
    # the survivor's KV moved slots and it still produced exactly what it produces alone
    assert run.tokens[("keep", 0)] == ref.tokens[("keep", 0)]
    assert run.finals("keep")[0].finish_reason == "length"
    assert len(run.finals("victim")) == 1  # nothing after the final


def test_cancelled_while_waiting_never_runs(make_scheduler, prompts):
    run = Run(make_scheduler(slots=1))
    flag = threading.Event()
    run.add("busy", prompts[0], greedy(6, ignore_eos=True))
    run.add("queued", prompts[1], greedy(6, ignore_eos=True), is_cancelled=flag.is_set)
    run.step()
    assert run.sched.scheduler.queue_depth == 1
    flag.set()
    run.step()
    assert run.sched.scheduler.queue_depth == 0
    assert [o.finish_reason for o in run.outputs["queued"]] == ["cancelled"]
    run.until_done()
    assert ("queued", 0) not in run.tokens


def test_queue_full_fails_fast(real_engine, prompts):
    eng = real_engine
    saved = eng.config.max_queue
    stop = threading.Event()
    queues: list[queue.Queue] = []

    def submit(rid: str, prompt_ids, params) -> queue.Queue:
        q: queue.Queue = queue.Queue()
        eng.submit(EngineRequest(rid, prompt_ids, params, q.put, True, stop.is_set))
        queues.append(q)
        return q

    try:
        # one request as wide as the engine occupies every slot, so later ones must wait in the queue
        wide = submit("wide", prompts[0], SamplingParams(n=ENGINE_SLOTS, temperature=1.0, max_tokens=80,
                                                          ignore_eos=True))
        wide.get(timeout=60)  # decoding now
        eng.config.max_queue = 2
        submit("w0", prompts[1], greedy(4))
        submit("w1", prompts[1], greedy(4))
        # refused at once: the wide request still holds every slot (all three end `cancelled` below, none
        # finished), so a submit that waited for room instead would still be waiting
        with pytest.raises(QueueFull) as info:
            submit("over", prompts[1], greedy(4))
        assert info.value.code == "QUEUE_FULL"
    finally:
        eng.config.max_queue = saved
        stop.set()
    for q in queues:
        assert _drain(q)[-1].finish_reason == "cancelled"


# -- n and best_of -------------------------------------------------------------------------------------


def test_n3_streams_three_indexed_choices(make_scheduler, prompts):
    run = Run(make_scheduler())
    run.add("n3", prompts[0], SamplingParams(n=3, temperature=1.0, seed=3, max_tokens=10, ignore_eos=True))
    run.until_done()
    outs = run.outputs["n3"]
    assert {o.index for o in outs} == {0, 1, 2}
    for index in range(3):
        closing = [o for o in outs if o.index == index and o.finish_reason is not None]
        assert len(closing) == 1 and closing[0].finish_reason == "length"
        assert closing[0].completion_tokens == 10
        assert len(run.tokens[("n3", index)]) == 10
    assert sum(o.final for o in outs) == 1 and outs[-1].final
    assert all(o.prompt_tokens == len(prompts[0]) for o in outs)  # the prompt counted once per request
    assert len({tuple(run.tokens[("n3", i)]) for i in range(3)}) == 3  # distinct candidates
    assert sum(1 for o in outs if o.text) > 3  # streamed deltas, not one blob per choice


def test_best_of_returns_top_n_by_cumulative_logprob(make_scheduler, prompts):
    run = Run(make_scheduler())
    params = SamplingParams(n=2, best_of=4, temperature=1.0, seed=11, max_tokens=8, ignore_eos=True, logprobs=True)
    run.add("bo", prompts[2], params)
    run.until_done()
    progress = [o for o in run.outputs["bo"] if o.progress]
    outs = [o for o in run.outputs["bo"] if not o.progress]
    # one empty progress output at the first token (gateway first-token timeout), nothing else streamed
    assert [(o.text, o.finish_reason, o.final) for o in progress] == [("", None, False)]
    assert len(outs) == 2  # buffered: one closing output per returned choice
    assert [o.index for o in outs] == [0, 1]
    assert [o.final for o in outs] == [False, True]
    assert all(o.finish_reason == "length" and o.completion_tokens == 8 for o in outs)
    returned = [sum(e["logprob"] for e in o.logprobs) for o in outs]
    candidates = sorted((s.cum_logprob for s in run.groups["bo"].sequences), reverse=True)
    assert len(candidates) == 4
    assert returned == pytest.approx(candidates[:2], abs=1e-4)
    assert returned[0] >= returned[1]


# -- stop strings through the scheduler ---------------------------------------------------------------


def test_stop_string_trims_and_reports(make_scheduler, prompts):
    ref = Run(make_scheduler())
    ref.add("r", prompts[3], greedy(30, ignore_eos=True))
    ref.until_done()
    text = ref.text("r")
    assert len(text) > 40
    stop = text[15:27]  # spans several tokens, somewhere in the middle
    cut = text.index(stop)

    run = Run(make_scheduler())
    run.add("s", prompts[3], greedy(30, ignore_eos=True, stop=["never-appears", stop]))
    run.until_done()
    assert run.text("s") == text[:cut]
    final = run.finals("s")[0]
    assert final.finish_reason == "stop" and final.stop_reason == stop
    assert all(stop not in o.text for o in run.outputs["s"])


def test_penalties_over_many_steps(make_scheduler, prompts):
    """Penalty counts are created inside the sampler's inference mode and updated after every token."""
    run = Run(make_scheduler())
    params = greedy(12, ignore_eos=True, frequency_penalty=1.5, presence_penalty=1.0, repetition_penalty=1.3)
    run.add("p", prompts[0], params)
    run.until_done()
    final = run.finals("p")[0]
    assert final.error is None and final.finish_reason == "length"
    tokens = run.tokens[("p", 0)]
    assert len(tokens) == 12
    seq_counts = torch.bincount(torch.tensor(tokens))
    assert seq_counts.max() <= 3  # heavy penalties keep greedy decoding from looping on one token


def test_retired_sequences_give_their_blocks_back_and_a_moved_row_takes_its_table_along(
        real_engine, make_scheduler, prompts):
    """A retiring sequence's blocks go back to the pool at once, and the rows after it move down by moving their
    block tables (no K/V is copied), so a moved sequence reads its own K/V and nothing of the retired one's: its
    tokens equal the same request alone. Idle, every block is back: memory never ratchets up over hours."""
    longest = real_engine.encode_prompt(messages=[{"role": "user", "content": "Describe the sea. " * 20}])
    shortest = min(prompts, key=len)
    ref = Run(make_scheduler())
    ref.add("b", shortest, greedy(40, ignore_eos=True))
    ref.until_done()

    run = Run(make_scheduler())
    run.add("a", longest, greedy(3, ignore_eos=True))  # row 0, the longer K/V, finishes first
    run.add("c", prompts[1], greedy(6, ignore_eos=True))
    run.add("b", shortest, greedy(40, ignore_eos=True))  # row 2: moves down into row 1, then row 0
    sched = run.sched.scheduler
    while not run.finals("a"):
        run.step()
    held = {block for seq in sched.running for block in seq.blocks}
    assert sched.kv.pool.used == len(held)  # a's blocks are back
    run.step()
    c, b = sched.running
    assert b.group is run.groups["b"] and b.slot == 1
    rows = sched.kv.cache.rows
    assert list(rows[1, : len(b.blocks)]) == b.blocks and not rows[1, len(b.blocks):].any()
    run.until_done()
    assert sched.kv.pool.used == 0 and sched.kv.pool.available == sched.kv.total_blocks  # idle: nothing held
    assert run.tokens[("b", 0)] == ref.tokens[("b", 0)]
