"""When a candidate stops and what text it ends with, on the real SmolLM2 model (synchronous scheduler)."""

from __future__ import annotations

import pytest

from .engine_run import PROMPTS, Run, greedy


@pytest.fixture(scope="module")
def prompts(real_engine) -> list[list[int]]:
    return [real_engine.encode_prompt(messages=[{"role": "user", "content": p}]) for p in PROMPTS]


def test_min_tokens_holds_back_stop_strings(make_scheduler, prompts, tokenizer):
    """Contract: min_tokens tokens are emitted before any stop condition can fire; stop strings included
    (vLLM checks them only past min_tokens). A stop string first completed after that fires as usual."""
    run = Run(make_scheduler())
    run.add("free", prompts[0], greedy(30, stop=["e"]))
    run.add("held", prompts[0], greedy(30, stop=["e"], min_tokens=12))
    run.until_done()
    assert len(run.ids("free")) < 12  # "e" comes early in this answer: the test means something
    held = run.final("held")
    ids = run.ids("held")
    assert len(ids) >= 12
    text = run.text("held")
    assert held.finish_reason == "stop" and held.stop_reason == "e"
    assert "e" in tokenizer.decode(ids[:12])  # an "e" before min_tokens was not taken as the stop
    assert not text.endswith("e")  # the match after min_tokens is trimmed as usual
    assert tokenizer.decode(ids).startswith(text)


@pytest.mark.parametrize("stream", [True, False])
def test_a_candidate_cut_inside_a_character_ends_with_the_replacement_character(make_scheduler, prompts, tokenizer,
                                                                               stream):
    """max_tokens ends the candidate after the first byte token of an emoji: streamed and blocking both end
    with U+FFFD (what the tokenizer decodes the held bytes to), not with the bytes silently dropped."""
    first_byte = tokenizer.encode("😀", add_special_tokens=False)[0]
    assert tokenizer.decode([first_byte]) == "\ufffd"
    run = Run(make_scheduler())
    run.add("cut", prompts[0], greedy(1, logit_bias={first_byte: 100.0}), stream=stream)
    run.until_done()
    assert run.ids("cut") == [first_byte]
    assert run.final("cut").finish_reason == "length"
    assert run.text("cut") == "\ufffd"
