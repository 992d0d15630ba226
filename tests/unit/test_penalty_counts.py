"""The sampler's device-side output-token counts (engine.sampling.penalty_counts) equal counting output_ids."""

from __future__ import annotations

import gc

import torch

from engine.sampling.penalty_counts import PenaltyCounts

VOCAB = 11


class Row:
    def __init__(self, ids=()) -> None:
        self.output_ids = list(ids)


def counted(rows) -> torch.Tensor:
    want = torch.zeros(len(rows), VOCAB)
    for j, row in enumerate(rows):
        for t in row.output_ids:
            want[j, t] += 1
    return want


def gather(counts: PenaltyCounts, rows) -> torch.Tensor:
    return counts.gather(rows, VOCAB, torch.float32, torch.device("cpu"))


def test_counts_follow_tokens_added_between_steps_in_any_row_order():
    counts = PenaltyCounts()
    a, b = Row([3, 3]), Row()
    assert torch.equal(gather(counts, [a, b]), counted([a, b]))
    a.output_ids += [5]
    b.output_ids += [3, 7]
    assert torch.equal(gather(counts, [b, a]), counted([b, a]))  # order of the step, not of first sight
    a.output_ids += [3]
    assert torch.equal(gather(counts, [a]), counted([a]))  # a step without b leaves b's counts alone
    b.output_ids += [1]
    assert torch.equal(gather(counts, [a, b]), counted([a, b]))


def test_a_finished_rows_buffer_row_is_reused_from_zero():
    counts = PenaltyCounts()
    rows = [Row([i % VOCAB] * 3) for i in range(8)]  # the initial capacity
    gather(counts, rows)
    rows.pop(0)
    gc.collect()
    newcomer = Row([9])
    rows.append(newcomer)
    assert counts.buffer is not None and counts.buffer.shape[0] == 8  # reused, not grown
    assert torch.equal(gather(counts, rows), counted(rows))


def test_more_rows_than_capacity_grow_the_buffer_and_keep_counts():
    counts = PenaltyCounts()
    first = [Row([1, 2]) for _ in range(8)]
    gather(counts, first)
    more = first + [Row([4] * (i + 1)) for i in range(9)]
    for row in first:
        row.output_ids.append(6)
    assert torch.equal(gather(counts, more), counted(more))
    assert counts.buffer is not None and counts.buffer.shape[0] == 32


def test_the_gathered_counts_are_a_copy():
    counts = PenaltyCounts()
    row = Row([2])
    gather(counts, [row]).add_(100)
    assert torch.equal(gather(counts, [row]), counted([row]))


def test_a_released_row_is_free_at_once_while_its_sequence_is_still_referenced():
    counts = PenaltyCounts()
    rows = [Row([i % VOCAB] * 3) for i in range(8)]
    gather(counts, rows)
    done = rows.pop(0)  # still referenced (as a finished sequence is, by its request, until the cyclic GC runs)
    counts.release(done)
    rows.append(Row([9]))
    assert torch.equal(gather(counts, rows), counted(rows))
    assert counts.buffer is not None and counts.buffer.shape[0] == 8  # its row was reused, not grown


def test_the_scheduler_frees_a_finished_sequences_row_without_the_garbage_collector(make_scheduler, tokenizer):
    """Sequences sit in reference cycles (group <-> sequence): without an explicit release their counts rows
    stay taken until the cyclic GC runs, and the buffer grows instead."""
    from engine.sampling_params import SamplingParams

    from .engine_run import Run

    sched = make_scheduler()
    run = Run(sched)
    prompt = tokenizer.encode("Count to ten:")
    run.add("pen", prompt, SamplingParams(temperature=0.0, max_tokens=4, n=2, frequency_penalty=0.5))
    gc.disable()
    try:
        run.until_done()
        assert run.final("pen").finish_reason in ("stop", "length")
        assert not any(seq in sched.sampler.counts.rows for seq in run.groups["pen"].sequences)
    finally:
        gc.enable()
