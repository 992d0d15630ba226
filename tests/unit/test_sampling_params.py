"""The engine's own boundary: `SamplingParams.from_dict` checks every type and range and names the parameter,
because Triton's own clients (perf_analyzer, genai-perf, tritonclient) drive the model without the gateway.
Torch-free on purpose: it also runs under the NGC image's Python 3.10 (`.ci/py310`)."""

from __future__ import annotations

import dataclasses
import json
import math

import pytest

from engine.errors import EngineError
from engine.sampling_params import (
    _TYPE_RULES,
    VLLM_BOOL_KEYS,
    VLLM_FLOAT_KEYS,
    VLLM_INT_KEYS,
    SamplingParams,
)


def _reject(raw: dict, param: str) -> EngineError:
    with pytest.raises(EngineError) as caught:
        SamplingParams.from_dict(raw)
    err = caught.value
    assert (err.code, err.param) == ("invalid_request", param), err.message
    assert json.loads(err.to_json())["param"] == param
    return err


# --- types -------------------------------------------------------------------------------------------------------

@pytest.mark.parametrize(
    ("raw", "param"),
    [
        ({"max_tokens": 3.5}, "max_tokens"),
        ({"max_tokens": True}, "max_tokens"),
        ({"max_tokens": [4]}, "max_tokens"),
        ({"n": "two"}, "n"),
        ({"best_of": 2.0}, "best_of"),
        ({"top_k": "1.5"}, "top_k"),
        ({"min_tokens": {}}, "min_tokens"),
        ({"top_logprobs": "3"}, "top_logprobs"),  # not a key the vLLM backend parses from strings
        ({"seed": "42"}, "seed"),
        ({"seed": 1.0}, "seed"),
        ({"temperature": "hot"}, "temperature"),
        ({"temperature": float("nan")}, "temperature"),
        ({"top_p": "inf"}, "top_p"),
        ({"repetition_penalty": "1.1"}, "repetition_penalty"),
        ({"presence_penalty": False}, "presence_penalty"),
        ({"logprobs": "true"}, "logprobs"),
        ({"logprobs": 1}, "logprobs"),
        ({"ignore_eos": "maybe"}, "ignore_eos"),
        ({"include_reasoning": 0}, "include_reasoning"),
        ({"parallel_tool_calls": "no"}, "parallel_tool_calls"),
        ({"stop": 5}, "stop"),
        ({"stop": ["ok", 3]}, "stop"),
        ({"stop_token_ids": 2}, "stop_token_ids"),
        ({"stop_token_ids": [1, "2"]}, "stop_token_ids"),
        ({"stop_token_ids": [True]}, "stop_token_ids"),
        ({"logit_bias": [1, 2]}, "logit_bias"),
        ({"lora_adapter": 7}, "lora_adapter"),
        ({"grammar": "json"}, "grammar"),
        ({"tools": {"type": "function"}}, "tools"),
        ({"tools": ["f"]}, "tools"),
        ({"tool_choice": 3}, "tool_choice"),
        ({"chat_template_kwargs": ["enable_thinking"]}, "chat_template_kwargs"),
    ],
)
def test_wrong_types_name_the_parameter(raw, param):
    _reject(raw, param)


def test_every_field_has_a_type_rule():
    """A new field without a rule would pass any JSON value into the engine unchecked."""
    unchecked = {f.name for f in dataclasses.fields(SamplingParams)} - set(_TYPE_RULES)
    assert unchecked == set()


def test_unknown_key_and_non_object():
    _reject({"max_token": 4}, "max_token")
    with pytest.raises(EngineError) as caught:
        SamplingParams.from_dict([1, 2])  # type: ignore[arg-type]
    assert caught.value.param == "sampling_parameters"


# --- ranges ------------------------------------------------------------------------------------------------------

@pytest.mark.parametrize(
    ("raw", "param"),
    [
        ({"max_tokens": 0}, "max_tokens"),
        ({"temperature": -0.1}, "temperature"),
        ({"top_p": 0}, "top_p"),
        ({"top_p": 1.01}, "top_p"),
        ({"top_k": -1}, "top_k"),
        ({"min_tokens": -1}, "min_tokens"),
        ({"presence_penalty": 2.5}, "presence_penalty"),
        ({"frequency_penalty": -2.01}, "frequency_penalty"),
        ({"repetition_penalty": 0}, "repetition_penalty"),
        ({"repetition_penalty": -1.0}, "repetition_penalty"),
        ({"top_logprobs": 21}, "top_logprobs"),
        ({"top_logprobs": -1}, "top_logprobs"),
        ({"n": 0}, "n"),
        ({"n": 3, "best_of": 2}, "best_of"),
        ({"seed": 2**63}, "seed"),
        ({"seed": -(2**63) - 1}, "seed"),
        ({"stop": ["ok", ""]}, "stop"),
        ({"stop_token_ids": [5, -1]}, "stop_token_ids"),
        ({"logit_bias": {"abc": 1}}, "logit_bias"),
        ({"logit_bias": {"-3": 1}}, "logit_bias"),
        ({"logit_bias": {"3": 101}}, "logit_bias"),
        ({"logit_bias": {"3": "1"}}, "logit_bias"),
        ({"grammar": {"kind": "yaml", "value": "x"}}, "grammar"),
        ({"grammar": {"kind": "regex", "value": "a+", "flags": 1}}, "grammar"),
        ({"grammar": {"kind": "regex", "value": "a+", "strict": "yes"}}, "grammar"),
    ],
)
def test_out_of_range_values_name_the_parameter(raw, param):
    _reject(raw, param)


def test_valid_extremes_are_accepted():
    params = SamplingParams.from_dict({
        "seed": -(2**63), "temperature": 0, "top_p": 1, "top_k": 0, "presence_penalty": -2, "frequency_penalty": 2,
        "repetition_penalty": 1e-3, "top_logprobs": 20, "logprobs": True, "n": 2, "best_of": 2,
        "stop": "END", "stop_token_ids": [0, 7], "logit_bias": {"5": -100, 6: 100},
        "grammar": {"kind": "regex", "value": "a+"},
    })
    assert params.seed == -(2**63)
    assert params.stop == ["END"]  # a single string, as the vLLM backend accepts it
    assert params.stop_token_ids == [0, 7]
    assert params.logit_bias == {5: -100.0, 6: 100.0}
    assert params.grammar is not None and params.grammar.kind == "regex"
    assert SamplingParams.from_dict({"seed": 2**63 - 1}).seed == 2**63 - 1


# --- numeric strings, exactly where Triton's vLLM backend parses them ---------------------------------------------

def test_genai_perf_sampling_parameters():
    """What genai-perf 0.0.16 (`--backend vllm`) sends: token counts as strings."""
    params = SamplingParams.from_dict(json.loads('{"max_tokens": "32", "min_tokens": "32"}'))
    assert (params.max_tokens, params.min_tokens) == (32, 32)
    assert params.clamp_max_tokens is False  # the client set the cap


@pytest.mark.parametrize("key", sorted(VLLM_INT_KEYS))
def test_int_keys_take_integer_strings(key):
    raw = {key: " 3 "}
    if key == "best_of":
        raw["n"] = 1
    assert getattr(SamplingParams.from_dict(raw), key) == 3
    _reject({key: "3.5"}, key)


@pytest.mark.parametrize("key", sorted(VLLM_FLOAT_KEYS))
def test_float_keys_take_numeric_strings(key):
    value = getattr(SamplingParams.from_dict({key: "0.5"}), key)
    assert isinstance(value, float) and math.isclose(value, 0.5)
    _reject({key: "nan"}, key)


@pytest.mark.parametrize(("text", "expected"), [("true", True), ("False", False), ("1", True), ("0", False)])
def test_bool_keys_take_words(text, expected):
    assert {"ignore_eos"} == VLLM_BOOL_KEYS
    assert SamplingParams.from_dict({"ignore_eos": text}).ignore_eos is expected


def test_defaults_still_apply_and_explicit_caps_are_not_clamped():
    params = SamplingParams.from_dict({"top_k": "5"}, {"temperature": 0.2, "top_p": 0.9})
    assert (params.temperature, params.top_p, params.top_k) == (0.2, 0.9, 5)
    assert params.clamp_max_tokens is True  # max_tokens came from the default
