"""Grammar compiles within a time budget, and a grammar that matches nothing is the request's fault.

A grammar can take minutes to compile, and a request must not hold its caller (and Triton's intake) that long:
over the budget the request is refused with a 400 while the compile finishes in the background."""

from __future__ import annotations

import threading

import pytest

from engine.errors import EngineError
from engine.sampling_params import GrammarRequest
from tests.helpers.waiting import poll, wait_until

# a shape clients send: string properties with long bounded repetitions compile for many seconds
SLOW_SCHEMA = {"type": "object",
               "properties": {f"p{i}": {"type": "string", "pattern": "[a-x]{1,3000}q"} for i in range(4)}}


@pytest.fixture
def grammars(real_engine, monkeypatch):
    monkeypatch.setattr(real_engine.grammars, "budget_s", 1.0, raising=False)
    return real_engine.grammars


HELD = "held-(yes|no)"  # a regex whose compile waits for the test: slower than any budget, on any machine


@pytest.fixture
def held_compile(grammars, monkeypatch):
    """Compiles of the HELD grammar wait until the test sets the returned event; others compile as usual."""
    release = threading.Event()
    compile_now = grammars._compile

    def compile_held(grammar):
        if grammar.value == HELD:
            release.wait(120)
        return compile_now(grammar)

    monkeypatch.setattr(grammars, "_compile", compile_held)
    yield release
    release.set()
    # the held compile leaves no thread busy for the next test
    poll(lambda: grammars._compiling, 60, until=lambda compiling: not compiling, interval_s=0.02)


def test_a_grammar_over_the_compile_budget_is_refused_naming_the_field(grammars):
    # the shape a client sent: string properties with long bounded repetitions compile for many seconds
    with pytest.raises(EngineError) as info:
        grammars.new_state(GrammarRequest("json_schema", SLOW_SCHEMA))
    assert (info.value.code, info.value.param) == ("grammar_invalid", "grammar")
    assert "budget" in info.value.message  # refused by the budget, not after the compile ended


def test_a_plain_grammar_compiles_while_a_slow_one_is_still_compiling(grammars, held_compile):
    # a compile an earlier test left running holds one of the two threads
    wait_until(lambda: not grammars._compiling, 60, "an earlier test's compile never ended", interval_s=0.05)
    with pytest.raises(EngineError) as info:
        grammars.new_state(GrammarRequest("regex", HELD))
    assert "budget" in info.value.message
    state = grammars.new_state(GrammarRequest("regex", "(yes|no)"))  # a compile thread is still free
    assert not state.is_terminated()
    assert any(HELD in key for key in grammars._compiling)  # and the held one had not finished meanwhile
    held_compile.set()


@pytest.mark.parametrize("ebnf", ["root ::= root", 'root ::= a\na ::= a "x"'])
def test_an_ebnf_grammar_that_matches_no_text_is_a_grammar_error(grammars, ebnf):
    with pytest.raises(EngineError) as info:
        grammars.new_state(GrammarRequest("ebnf", ebnf))
    assert (info.value.code, info.value.param) == ("grammar_invalid", "grammar")
