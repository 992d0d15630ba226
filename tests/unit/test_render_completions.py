"""text_completion rendering without the app: the legacy logprobs object and per-choice stream state."""

from __future__ import annotations

from typing import Any

from gateway.domain import GenerationEvent, GenerationResult
from gateway.render.completions import CompletionShape, CompletionStreamRenderer, legacy_logprobs, render_completion


def entry(token: str, logprob: float, *top: tuple[str, float]) -> dict[str, Any]:
    return {"token": token, "logprob": logprob, "bytes": list(token.encode()),
            "top_logprobs": [{"token": t, "logprob": lp, "bytes": []} for t, lp in top]}


def shape(prompts: tuple[str, ...] = ("P",), n: int = 1, echo: bool = False, logprobs: int | None = None):
    return CompletionShape("rid", 1700000000, "org/model", prompts, n, echo, logprobs)


def test_legacy_logprobs_offsets_start_where_told_and_follow_token_lengths() -> None:
    out = legacy_logprobs([entry("ab", -0.1), entry("c", -0.2), entry("de", -0.3)], offset=5)
    assert out["tokens"] == ["ab", "c", "de"]
    assert out["token_logprobs"] == [-0.1, -0.2, -0.3]
    assert out["text_offset"] == [5, 7, 8]


def test_top_logprobs_keep_the_best_of_tokens_that_decode_alike_and_add_the_sampled_one() -> None:
    out = legacy_logprobs([entry(" x", -2.0, (" a", -0.5), (" a", -0.9), (" b", -1.0))], offset=0)
    assert out["top_logprobs"] == [{" a": -0.5, " b": -1.0, " x": -2.0}]


def test_no_entries_is_an_empty_object() -> None:
    assert legacy_logprobs(None, 0) == {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}


def test_blocking_finish_reasons_map_to_openai_values() -> None:
    choices = {i: {"text": "t", "finish_reason": f, "logprobs": []}
               for i, f in enumerate(["stop", "length", "tool_calls", "content_filter"])}
    body = render_completion(shape(n=4), GenerationResult(choices, 1, 4, None, None))
    assert [c["finish_reason"] for c in body["choices"]] == ["stop", "length", "stop", "content_filter"]
    assert body["id"] == "cmpl-rid" and body["object"] == "text_completion"


def test_stream_usage_counts_each_prompt_once_however_many_candidates() -> None:
    renderer = CompletionStreamRenderer(shape(prompts=("a", "b"), n=2), include_usage=True)
    for index, prompt_tokens in ((0, 3), (1, 3), (2, 7), (3, 7)):
        renderer.on_event(GenerationEvent(index=index, text="x", prompt_tokens=prompt_tokens))
        renderer.on_event(GenerationEvent(index=index, text="", finish_reason="stop", prompt_tokens=prompt_tokens,
                                          completion_tokens=2))
    usage = renderer.usage_chunk()
    assert usage is not None and usage["choices"] == []
    assert usage["usage"] == {"prompt_tokens": 10, "completion_tokens": 8, "total_tokens": 18,
        "prompt_tokens_details": {"cached_tokens": 0}}


def test_stream_without_include_usage_has_no_usage_chunk() -> None:
    assert CompletionStreamRenderer(shape(), include_usage=False).usage_chunk() is None


def test_stream_echo_once_per_choice_even_when_the_first_event_is_empty() -> None:
    renderer = CompletionStreamRenderer(shape(prompts=("a", "b"), n=1, echo=True), include_usage=False)
    first = renderer.on_event(GenerationEvent(index=1, text=""))
    second = renderer.on_event(GenerationEvent(index=1, text="z"))
    assert [c["choices"][0]["text"] for c in first + second] == ["b", "z"]
