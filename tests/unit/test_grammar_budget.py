"""Grammar compiles within a time budget, and a grammar that matches nothing is the request's fault (issue 20)."""

from __future__ import annotations

import time

import pytest

from engine.errors import EngineError
from engine.sampling_params import GrammarRequest

# the shape: string properties with long bounded repetitions compile for many seconds
SLOW_SCHEMA = {"type": "object",
               "properties": {f"p{i}": {"type": "string", "pattern": "[a-x]{1,3000}q"} for i in range(4)}}


@pytest.fixture
def grammars(real_engine, monkeypatch):
    monkeypatch.setattr(real_engine.grammars, "budget_s", 1.0, raising=False)
    return real_engine.grammars


def test_a_grammar_over_the_compile_budget_is_refused_in_time_naming_the_field(grammars):
    started = time.monotonic()
    with pytest.raises(EngineError) as info:
        grammars.new_state(GrammarRequest("json_schema", SLOW_SCHEMA))
    assert time.monotonic() - started < 4.0
    assert (info.value.code, info.value.param) == ("grammar_invalid", "grammar")
    assert "budget" in info.value.message


def test_a_plain_grammar_compiles_while_a_slow_one_is_still_compiling(grammars):
    # a schema of its own (not one an earlier test left compiling or cached), about 5 s to compile on a quiet
    # 2-core box: it is still compiling well after its 1 s budget has refused it
    slower = {"type": "object", "properties": {f"s{i}": {"type": "string", "pattern": "[a-x]{1,3000}q"}
                                               for i in range(8)}}
    deadline = time.monotonic() + 60
    while grammars._compiling:  # a compile an earlier test left running holds one of the two threads
        assert time.monotonic() < deadline
        time.sleep(0.05)
    with pytest.raises(EngineError):
        grammars.new_state(GrammarRequest("json_schema", slower))
    started = time.monotonic()
    state = grammars.new_state(GrammarRequest("regex", "(yes|no)"))  # a compile thread is still free
    assert not state.is_terminated() and time.monotonic() - started < 1.0


@pytest.mark.parametrize("ebnf", ["root ::= root", 'root ::= a\na ::= a "x"'])
def test_an_ebnf_grammar_that_matches_no_text_is_a_grammar_error(grammars, ebnf):
    with pytest.raises(EngineError) as info:
        grammars.new_state(GrammarRequest("ebnf", ebnf))
    assert (info.value.code, info.value.param) == ("grammar_invalid", "grammar")
