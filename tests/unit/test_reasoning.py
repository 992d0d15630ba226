"""Reasoning split: `<think>` text apart from content, at every split point and through the scheduler."""

from __future__ import annotations

import pytest

from engine.request import EngineRequest
from engine.sampling_params import SamplingParams
from engine.text.reasoning import ReasoningSplitter

TEXT = "<think>plan a reply</think>Paris is the capital."


def _split(text: str, cut: int, inside: bool = False) -> tuple[str, str]:
    splitter = ReasoningSplitter(inside)
    parts = [splitter.feed(text[:cut]), splitter.feed(text[cut:]), splitter.flush()]
    return "".join(p[0] for p in parts), "".join(p[1] for p in parts)


@pytest.mark.parametrize("cut", range(len(TEXT) + 1))
def test_split_at_every_point(cut):
    assert _split(TEXT, cut) == ("plan a reply", "Paris is the capital.")


def test_template_opened_block_and_unclosed_thinking():
    assert _split("thinking</think>answer", 4, inside=True) == ("thinking", "answer")
    assert _split("<think>never closed", 3) == ("never closed", "")
    assert _split("a <thin", 2) == ("", "a <thin")  # a tag prefix that never completes is content


def _run(make_scheduler, include: bool, stream: bool) -> tuple[str, str, list]:
    sched = make_scheduler()
    sched.scheduler.reasoning = True
    outputs = []
    grammar = {"kind": "regex", "value": "<think>[a-z ]{3,12}</think>[A-Z][a-z]{2,8}"}
    params = SamplingParams.from_dict({"max_tokens": 48, "grammar": grammar, "include_reasoning": include})
    from engine.sampling.grammar import GrammarCompilerCache

    cache = GrammarCompilerCache(sched.scheduler.tokenizer, sched.runner.vocab_size, sched.sampler.stop_token_set)
    prompt = sched.scheduler.tokenizer.encode("Think, then answer:")
    request = EngineRequest("r", prompt, params, outputs.append, stream)
    request.grammar = lambda: cache.new_state(params.grammar)
    sched.scheduler.add(request)
    for _ in range(100):
        if not sched.scheduler.has_work():
            break
        sched.step()
    return "".join(o.reasoning or "" for o in outputs), "".join(o.text for o in outputs), outputs


@pytest.mark.parametrize("stream", [True, False])
def test_scheduler_returns_reasoning_only_when_asked(make_scheduler, stream):
    reasoning, content, outputs = _run(make_scheduler, include=True, stream=stream)
    assert outputs[-1].final and outputs[-1].finish_reason == "stop"
    assert reasoning and "<think>" not in reasoning and "</think>" not in reasoning
    assert content and "<" not in content
    hidden, content_again, _ = _run(make_scheduler, include=False, stream=stream)
    assert hidden == "" and content_again == content
