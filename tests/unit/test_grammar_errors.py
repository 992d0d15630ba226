"""A grammar that does not compile is reported in the client's terms, without xgrammar's log prefix."""

from __future__ import annotations

import pytest

from engine.errors import EngineError
from engine.sampling.grammar import GrammarCompilerCache, compile_error_message
from engine.sampling_params import GrammarRequest


def test_the_log_time_and_cpp_source_location_are_stripped():
    raw = RuntimeError('[13:29:40] /project/cpp/json_schema_converter.cc:5082: Unsupported type "nonsense"\n')
    assert compile_error_message(raw) == 'Unsupported type "nonsense"'
    assert compile_error_message(ValueError("Regex parsing error at position 3")) == \
        "Regex parsing error at position 3"


@pytest.fixture(scope="module")
def grammars(tokenizer):
    return GrammarCompilerCache(tokenizer, len(tokenizer), [tokenizer.eos_token_id])


@pytest.mark.parametrize("grammar, message", [
    (GrammarRequest("json_schema", {"type": "nonsense"}),
     'the json_schema grammar does not compile: Unsupported type "nonsense"'),
    (GrammarRequest("ebnf", "root ::= foo"),
     'the ebnf grammar does not compile: EBNF parser error at line 1, column 10: Rule "foo" is not defined'),
])
def test_a_grammar_that_does_not_compile_names_the_rule_and_no_engine_internals(grammars, grammar, message):
    with pytest.raises(EngineError) as info:
        grammars.new_state(grammar)
    assert (info.value.code, info.value.param, info.value.message) == ("grammar_invalid", "grammar", message)
