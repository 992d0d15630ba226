"""What the engine takes as a prompt besides text and messages, and what it refuses at intake (before any step):
token-id prompts (/v1/completions) and logit_bias ids the model has no logit for."""

from __future__ import annotations

import pytest

from engine.errors import EngineError
from engine.sampling_params import SamplingParams


def test_token_ids_are_the_prompt_as_they_are(real_engine):
    ids = real_engine.encode_prompt("The capital of France is")
    prompt_ids, embeds = real_engine.encode_inputs(None, None, SamplingParams(), None, list(ids))
    assert prompt_ids == ids and embeds is None


@pytest.mark.parametrize(("ids", "param"), [([], "prompt"), ([1, 10**9], "prompt[1]"), ([-1], "prompt[0]")])
def test_token_ids_outside_the_vocabulary_are_refused_naming_the_position(real_engine, ids, param):
    with pytest.raises(EngineError) as refused:
        real_engine.encode_inputs(None, None, SamplingParams(), None, ids)
    assert (refused.value.code, refused.value.param) == ("invalid_request", param)


def test_a_logit_bias_outside_the_vocabulary_is_refused(real_engine):
    vocab = real_engine.sampler.vocab_size
    inside = SamplingParams(logit_bias={0: 1.0, vocab - 1: -1.0})
    assert real_engine.encode_inputs("hi", None, inside)[0]  # every id the model has a logit for is fine
    for outside in (vocab, 10**9, -1):
        with pytest.raises(EngineError) as refused:
            real_engine.encode_inputs("hi", None, SamplingParams(logit_bias={outside: 5.0}))
        assert (refused.value.code, refused.value.param) == ("invalid_request", "logit_bias")
        assert str(outside) in refused.value.message
