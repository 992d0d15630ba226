"""Completions request contract: one row per rule (exact class, status, code, param) plus mappings."""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from gateway.contracts.completions import CompletionJob, parse_completion_request
from gateway.domain import GenerationRequest
from gateway.errors import GatewayError, InvalidRequest, UnsupportedField
from tests.unit.any_value import JSON_VALUES, check_any_value

DROP = object()


def body(**changes: Any) -> dict[str, Any]:
    out: dict[str, Any] = {"model": "org/model", "prompt": "Once upon"}
    for key, value in changes.items():
        if value is DROP:
            out.pop(key, None)
        else:
            out[key] = value
    return out


INV = (InvalidRequest, "invalid_request")
UNS = (UnsupportedField, "unsupported_field")

ERROR_ROWS: list[tuple[str, Any, tuple[type, str], str | None]] = [
    # body / allow-list
    ("body-array", [1], INV, None),
    ("body-null", None, INV, None),
    ("unknown-key", body(foo=1), UNS, "foo"),
    ("unknown-first-sorted", body(zeta=1, alpha=2), UNS, "alpha"),
    ("unknown-null-still-unknown", body(foo=None), UNS, "foo"),
    *[(f"chat-only-{k}", body(**{k: v}), UNS, k) for k, v in (
        ("messages", []), ("max_completion_tokens", 5), ("top_logprobs", 2), ("tools", []),
        ("response_format", {"type": "text"}), ("safety_identifier", "s"), ("include_reasoning", True),
    )],
    # model
    ("model-missing", body(model=DROP), INV, "model"),
    ("model-null", body(model=None), INV, "model"),
    ("model-empty", body(model=""), INV, "model"),
    ("model-int", body(model=5), INV, "model"),
    # prompt
    ("prompt-missing", body(prompt=DROP), INV, "prompt"),
    ("prompt-null", body(prompt=None), INV, "prompt"),
    ("prompt-empty", body(prompt=""), INV, "prompt"),
    ("prompt-int", body(prompt=5), INV, "prompt"),
    ("prompt-object", body(prompt={"text": "x"}), INV, "prompt"),
    ("prompt-empty-array", body(prompt=[]), INV, "prompt"),
    ("prompt-token-id-negative", body(prompt=[1, -2, 3]), INV, "prompt[1]"),
    ("prompt-token-id-float", body(prompt=[1, 2.0]), INV, "prompt[1]"),
    ("prompt-token-id-string", body(prompt=[1, "2"]), INV, "prompt[1]"),
    ("prompt-token-id-too-large", body(prompt=[2**31]), INV, "prompt[0]"),
    ("prompt-token-id-array-empty", body(prompt=[[1, 2], []]), INV, "prompt[1]"),
    ("prompt-token-id-array-bad", body(prompt=[[1, 2], [3, None]]), INV, "prompt[1][1]"),
    ("echo-with-token-ids", body(prompt=[1, 2], echo=True), UNS, "echo"),
    ("prompt-mixed", body(prompt=["a", 1]), INV, "prompt[1]"),
    ("prompt-empty-item", body(prompt=["a", ""]), INV, "prompt[1]"),
    ("prompt-null-item", body(prompt=["a", None]), INV, "prompt[1]"),
    ("prompt-bool-items", body(prompt=[True]), INV, "prompt[0]"),
    ("prompt-too-many-choices", body(prompt=["a"] * 65, n=2), INV, "prompt"),
    ("prompt-too-many-with-best_of", body(prompt=["a"] * 2, best_of=65), INV, "prompt"),
    # suffix / echo / logprobs
    ("suffix", body(suffix="end"), UNS, "suffix"),
    ("suffix-type", body(suffix=1), INV, "suffix"),
    ("echo-with-logprobs", body(echo=True, logprobs=0), UNS, "echo"),
    ("echo-type", body(echo="yes"), INV, "echo"),
    ("logprobs-bool", body(logprobs=True), INV, "logprobs"),
    ("logprobs-negative", body(logprobs=-1), INV, "logprobs"),
    ("logprobs-over-5", body(logprobs=6), INV, "logprobs"),
    ("logprobs-float", body(logprobs=1.0), INV, "logprobs"),
    # counts and sampler fields
    ("max_tokens-zero", body(max_tokens=0), INV, "max_tokens"),
    ("max_tokens-over-u32", body(max_tokens=2**32), INV, "max_tokens"),
    ("max_tokens-string", body(max_tokens="5"), INV, "max_tokens"),
    ("temperature-negative", body(temperature=-0.1), INV, "temperature"),
    ("temperature-string", body(temperature="1"), INV, "temperature"),
    ("top_p-zero", body(top_p=0), INV, "top_p"),
    ("top_p-over", body(top_p=1.1), INV, "top_p"),
    ("top_k-zero", body(top_k=0), INV, "top_k"),
    ("min_tokens-negative", body(min_tokens=-1), INV, "min_tokens"),
    ("repetition_penalty-zero", body(repetition_penalty=0), INV, "repetition_penalty"),
    ("repetition_penalty-over", body(repetition_penalty=2.5), INV, "repetition_penalty"),
    ("presence_penalty-range", body(presence_penalty=3), INV, "presence_penalty"),
    ("frequency_penalty-range", body(frequency_penalty=-3), INV, "frequency_penalty"),
    ("n-zero", body(n=0), INV, "n"),
    ("n-over", body(n=129), INV, "n"),
    ("best_of-below-n", body(n=3, best_of=2), INV, "best_of"),
    ("best_of-stream", body(best_of=2, stream=True), UNS, "best_of"),
    ("stop-int", body(stop=5), INV, "stop"),
    ("stop-empty-string", body(stop=["a", ""]), INV, "stop"),
    ("stop-33-entries", body(stop=[f"s{i}" for i in range(33)]), INV, "stop"),
    ("stop-entry-over-256-chars", body(stop=["x" * 257]), INV, "stop"),
    ("seed-float", body(seed=1.5), INV, "seed"),
    ("seed-over-i64", body(seed=2**63), INV, "seed"),
    ("logit_bias-key", body(logit_bias={"abc": 1}), INV, "logit_bias"),
    ("logit_bias-range", body(logit_bias={"1": 101}), INV, "logit_bias"),
    ("stream-string", body(stream="true"), INV, "stream"),
    ("stream_options-type", body(stream_options=5), INV, "stream_options"),
    ("stream_options-unknown", body(stream_options={"foo": 1}), UNS, "stream_options.foo"),
    ("ignore_eos-type", body(ignore_eos=1), INV, "ignore_eos"),
    ("user-type", body(user=5), INV, "user"),
    ("lora_adapter-empty", body(lora_adapter=""), INV, "lora_adapter"),
    ("routing_key-type", body(routing_key=[]), INV, "routing_key"),
]


@pytest.mark.parametrize(("payload", "expected", "param"), [pytest.param(p, e, q, id=i) for i, p, e, q in ERROR_ROWS])
def test_rejects(payload: Any, expected: tuple[type, str], param: str | None) -> None:
    cls, code = expected
    with pytest.raises(GatewayError) as info:
        parse_completion_request(payload)
    err = info.value
    assert type(err) is cls
    assert (err.status, err.code, err.param) == (400, code, param)
    assert "pydantic" not in err.message.lower() and "Input should" not in err.message


def job(**changes: Any) -> CompletionJob:
    return parse_completion_request(body(**changes))


def parse(**changes: Any) -> GenerationRequest:
    return job(**changes).request


def test_minimal_request_defaults() -> None:
    out = job()
    req = out.request
    assert (out.prompts, out.echo, out.logprobs) == (("Once upon",), False, None)
    assert req.model == "org/model" and req.prompt == "Once upon" and req.messages is None
    # OpenAI's default of 16 tokens, marked defaulted so a smaller model cap clamps it instead of failing
    assert (req.max_tokens, req.max_tokens_param, req.max_tokens_defaulted) == (16, "max_tokens", True)
    assert (req.stream, req.include_usage, req.n, req.logprobs, req.top_logprobs) == (False, False, 1, False, 0)
    # the engine names `max_tokens` in a context error, and clamps this default to the context left
    assert req.sampling_parameters() == {"max_tokens": 16, "n": 1, "max_tokens_param": "max_tokens",
                                         "clamp_max_tokens": True}


def test_explicit_max_tokens_is_not_defaulted() -> None:
    req = parse(max_tokens=200)
    assert (req.max_tokens, req.max_tokens_defaulted) == (200, False)


def test_prompt_array_keeps_order_and_first_prompt_drives_the_request() -> None:
    out = job(prompt=["a", "b", "c"], n=2)
    assert out.prompts == ("a", "b", "c") and out.request.prompt == "a" and out.request.n == 2
    assert job(prompt=["a"] * 64, n=2).prompts == ("a",) * 64  # 128 candidates: at the limit


def test_token_id_prompts_are_taken_as_they_are() -> None:
    """OpenAI's and vLLM's token-id forms (lm-eval-harness sends them): one array, or one array per prompt."""
    one = job(prompt=[504, 3575, 282])
    assert one.prompts == ((504, 3575, 282),)
    assert (one.request.prompt, one.request.prompt_token_ids) == (None, (504, 3575, 282))
    several = job(prompt=[[504, 3575], [504]], n=2)
    assert several.prompts == ((504, 3575), (504,))
    assert job(prompt=["text", [1, 2]]).prompts == ("text", (1, 2))  # each prompt in its own form


def test_legacy_logprobs_maps_to_engine_top_logprobs() -> None:
    for k in range(6):
        out = job(logprobs=k)
        assert out.logprobs == k
        assert (out.request.logprobs, out.request.top_logprobs) == (True, k)
        assert out.request.sampling_parameters()["top_logprobs"] == k


def test_echo_and_empty_suffix_are_accepted() -> None:
    assert job(echo=True).echo is True
    assert job(echo=False, logprobs=1).logprobs == 1
    assert job(suffix="") == job()


def test_null_means_absent_for_every_optional_field() -> None:
    optional = ["suffix", "max_tokens", "temperature", "top_p", "n", "best_of", "stream", "stream_options",
                "logprobs", "echo", "stop", "presence_penalty", "frequency_penalty", "logit_bias", "seed", "user",
                "top_k", "min_tokens", "repetition_penalty", "lora_adapter", "prompt_cache_key", "routing_key",
                "ignore_eos"]
    assert job(**{k: None for k in optional}) == job()


def test_vllm_bench_serve_body() -> None:
    req = parse(prompt="x y z", repetition_penalty=1.0, max_tokens=128, logprobs=None, stream=True,
                stream_options={"include_usage": True}, ignore_eos=True, temperature=0.0, min_tokens=128)
    assert (req.stream, req.include_usage, req.ignore_eos, req.logprobs) == (True, True, True, False)
    params = {k: v for k, v in req.sampling_parameters().items() if k != "max_tokens_param"}  # names the field
    assert params == {"max_tokens": 128, "n": 1, "temperature": 0.0, "min_tokens": 128,
                      "repetition_penalty": 1.0, "ignore_eos": True}


def test_user_is_dropped() -> None:
    """`user` only reaches admission (a fair-share tenant with auth off): never the wire, never a repr."""
    req = parse(user="alice@example.com")
    assert dataclasses.replace(req, user=None) == parse() and "alice" not in repr(req)
    assert "alice" not in str(req.sampling_parameters())


def test_sampler_fields_and_hints_are_carried() -> None:
    req = parse(temperature=0, top_p=1, top_k=40, repetition_penalty=2, min_tokens=3, frequency_penalty=-2,
                presence_penalty=2, seed=-(2**63), n=2, best_of=3, stop="END", logit_bias={"42": -100},
                lora_adapter="sql", routing_key="r", prompt_cache_key="p", ignore_eos=False)
    assert (req.temperature, req.top_p, req.top_k, req.repetition_penalty) == (0, 1, 40, 2)
    assert (req.min_tokens, req.frequency_penalty, req.presence_penalty) == (3, -2, 2)
    assert (req.seed, req.n, req.best_of, req.stop) == (-(2**63), 2, 3, ("END",))
    assert req.logit_bias == {42: -100.0}
    assert (req.lora_adapter, req.routing_key, req.prompt_cache_key, req.ignore_eos) == ("sql", "r", "p", False)
    assert "ignore_eos" not in req.sampling_parameters()
    assert req.grammar is None and req.tools is None and req.images == ()


def test_include_usage_only_when_streaming() -> None:
    assert parse(stream=True, stream_options={"include_usage": True}).include_usage is True
    assert parse(stream=False, stream_options={"include_usage": True}).include_usage is False


# ---- property: any JSON value in any field never escapes as another exception ----------------

FIELDS = ["model", "prompt", "suffix", "max_tokens", "temperature", "top_p", "n", "best_of", "stream",
          "stream_options", "logprobs", "echo", "stop", "presence_penalty", "frequency_penalty", "logit_bias",
          "seed", "user", "top_k", "min_tokens", "repetition_penalty", "lora_adapter", "prompt_cache_key",
          "routing_key", "ignore_eos"]
ODD_VALUES: list[Any] = [None, True, False, 0, -1, 1, 6, 1.5, -0.0, 2**64, float("inf"), "", "x", [], [None], [1],
                         [[1]], [[]], ["a", ""], [{}], {}, {"a": 1}, {"include_usage": 1}, {"1": 1}]


def _parse(b: dict[str, Any]) -> GenerationRequest:
    return parse_completion_request(b).request


@pytest.mark.parametrize("field", FIELDS)
def test_odd_values_in_every_field(field: str) -> None:
    for value in ODD_VALUES:
        check_any_value(_parse, body, field, value)


@settings(max_examples=300, deadline=None)
@given(field=st.sampled_from(FIELDS), value=JSON_VALUES)
def test_any_json_value_in_any_field(field: str, value: Any) -> None:
    check_any_value(_parse, body, field, value)
