"""The vLLM-backend output options of one request (engine/triton/reply.py); torch-free, also run under Python 3.10."""

from __future__ import annotations

from dataclasses import dataclass

import pytest

from engine.errors import EngineError
from engine.triton.reply import Reply


@dataclass
class Out:  # the fields of engine.core.sequence.RequestOutput that Reply reads
    index: int
    text: str
    prompt_tokens: int = 7
    completion_tokens: int = 0


def test_defaults_echo_nothing_and_add_no_outputs():
    reply = Reply(sender=object())
    reply.configure({}, "The prompt")
    assert reply.text(Out(0, " a")) == " a"
    assert reply.extra_outputs(Out(0, " a", completion_tokens=1)) == {}


def test_exclude_input_in_output_false_echoes_the_prompt_once_per_choice():
    reply = Reply(sender=object())
    reply.configure({"exclude_input_in_output": False}, "Hi:")
    assert [reply.text(o) for o in (Out(0, " a"), Out(1, " b"), Out(0, " c"), Out(1, ""))] == \
        ["Hi: a", "Hi: b", " c", ""]


def test_exclude_input_in_output_false_needs_a_text_prompt():
    with pytest.raises(EngineError) as caught:
        Reply(sender=object()).configure({"exclude_input_in_output": False}, None)
    assert (caught.value.code, caught.value.param) == ("invalid_request", "exclude_input_in_output")


def test_token_counts_are_per_response_deltas_per_choice():
    reply = Reply(sender=object())
    reply.configure({"return_num_input_tokens": True, "return_num_output_tokens": True}, None)
    seen = [reply.extra_outputs(Out(i, "", completion_tokens=n)) for i, n in ((0, 2), (1, 1), (0, 5), (1, 1))]
    assert [int(s["num_output_tokens"][0]) for s in seen] == [2, 1, 3, 0]
    assert {int(s["num_input_tokens"][0]) for s in seen} == {7}
    assert seen[0]["num_output_tokens"].dtype.name == "uint32"
