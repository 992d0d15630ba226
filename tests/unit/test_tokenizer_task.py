"""/tokenize and /detokenize on the real SmolLM2 tokenizer: the ids generation sees, vLLM's options, errors."""

from __future__ import annotations

import pytest

from engine.errors import EngineError
from engine.text.chat import render_chat
from engine.text.tokenizer_task import detokenize, tokenize

MESSAGES = [{"role": "user", "content": "What is the capital of France?"}]


def test_prompt_ids_and_token_strs(tokenizer):
    extras = tokenize(tokenizer, {"return_token_strs": True}, "The capital of France", None, 2048)
    assert extras["token_ids"] == tokenizer.encode("The capital of France")
    assert extras["token_strs"] == tokenizer.convert_ids_to_tokens(extras["token_ids"])
    assert extras["max_model_len"] == 2048


def test_messages_give_the_ids_a_generation_sees(tokenizer):
    extras = tokenize(tokenizer, {}, None, MESSAGES, 2048)
    assert extras["token_ids"] == render_chat(tokenizer, MESSAGES).encode(tokenizer)
    assert "token_strs" not in extras


def test_generation_prompt_and_continue_final_message(tokenizer):
    opened = tokenize(tokenizer, {"add_generation_prompt": True}, None, MESSAGES, 2048)["token_ids"]
    closed = tokenize(tokenizer, {"add_generation_prompt": False}, None, MESSAGES, 2048)["token_ids"]
    assert len(closed) < len(opened) and opened[:len(closed)] == closed
    partial = [*MESSAGES, {"role": "assistant", "content": "The capital is"}]
    cont = tokenize(tokenizer, {"add_generation_prompt": False, "continue_final_message": True}, None, partial,
                    2048)["token_ids"]
    assert tokenizer.decode(cont).rstrip().endswith("The capital is")


def test_detokenize_round_trip_and_bad_ids(tokenizer):
    ids = tokenizer.encode("Hello world")
    assert detokenize(tokenizer, ids, 2048)[0] == "Hello world"
    with pytest.raises(EngineError) as info:
        detokenize(tokenizer, [1, len(tokenizer) + 5], 2048)
    assert info.value.param == "tokens[1]"


@pytest.mark.parametrize(("options", "param"), [({"nope": 1}, "nope"), ({"add_special_tokens": "yes"},
                                                                       "add_special_tokens"), ([], "tokenize")])
def test_bad_options_name_the_key(tokenizer, options, param):
    with pytest.raises(EngineError) as info:
        tokenize(tokenizer, options, "x", None, 2048)
    assert info.value.code == "invalid_request" and info.value.param == param
