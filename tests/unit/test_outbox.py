"""Sender-side coalescing keeps each request's order and never merges closing outputs."""

from engine.errors import EngineError
from engine.request import RequestOutput
from engine.triton.outbox import coalesce


def out(index: int, text: str, finish: str | None = None, final: bool = False, lp=None, n: int = 0):
    return RequestOutput("r", index, text, finish_reason=finish, final=final, logprobs=lp, completion_tokens=n)


def test_runs_of_deltas_merge_per_choice_and_sender():
    a, b = object(), object()
    batch = [(a, out(0, "He", lp=[{"t": 1}], n=1)), (b, out(0, "x", n=1)), (a, out(1, "Yo", n=1)),
             (a, out(0, "llo", lp=[{"t": 2}], n=2)), (b, out(0, "y", n=2))]
    merged = coalesce(batch)
    assert [(s is a, o.index, o.text, o.completion_tokens) for s, o in merged] == [
        (True, 0, "Hello", 2), (False, 0, "xy", 2), (True, 1, "Yo", 1)]
    assert merged[0][1].logprobs == [{"t": 1}, {"t": 2}]


def test_closing_and_error_outputs_are_never_merged_or_jumped():
    a = object()
    batch = [(a, out(0, "a", n=1)), (a, out(0, "b", finish="stop", n=2)), (a, out(1, "c", n=1)),
             (a, out(1, "d", n=2)), (a, RequestOutput("r", 1, "", "error", final=True, error=EngineError("x", "y")))]
    merged = coalesce(batch)
    assert [(o.index, o.text, o.finish_reason) for _, o in merged] == [
        (0, "a", None), (0, "b", "stop"), (1, "cd", None), (1, "", "error")]
    assert merged[-1][1].final


def test_reasoning_deltas_are_merged_not_dropped():
    sender = object()
    batch = [
        (sender, RequestOutput("r", 0, "", reasoning="Let me ", completion_tokens=1)),
        (sender, RequestOutput("r", 0, "", reasoning="think.", completion_tokens=2)),
        (sender, RequestOutput("r", 0, "Answer", completion_tokens=3)),
    ]
    (merged,) = coalesce(batch)
    assert (merged[1].reasoning, merged[1].text, merged[1].completion_tokens) == ("Let me think.", "Answer", 3)
