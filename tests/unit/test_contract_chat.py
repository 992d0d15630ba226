"""Chat request contract: one row per rule (exact class, status, code, param) plus mappings."""

from __future__ import annotations

import base64
import dataclasses
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from gateway.contracts.chat import parse_chat_request
from gateway.domain import GenerationRequest, GrammarSpec, ImageInput
from gateway.errors import GatewayError, InvalidRequest, UnsupportedField
from tests.unit.any_value import JSON_VALUES, check_any_value

DROP = object()
PNG = b"\x89PNG\r\n\x1a\n" + b"\x00" * 8
PNG_URI = "data:image/png;base64," + base64.b64encode(PNG).decode()
JPEG_URI = "data:image/jpeg;base64," + base64.b64encode(b"\xff\xd8\xff\xe0").decode()
TOOL = {"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}
CALL = {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": "{}"}}


def body(**changes: Any) -> dict[str, Any]:
    out: dict[str, Any] = {"model": "org/model", "messages": [{"role": "user", "content": "hi"}]}
    for key, value in changes.items():
        if value is DROP:
            out.pop(key, None)
        else:
            out[key] = value
    return out


def msgs(*messages: Any) -> dict[str, Any]:
    return body(messages=list(messages))


def user(content: Any) -> dict[str, Any]:
    return {"role": "user", "content": content}


def image(url: Any) -> dict[str, Any]:
    return {"type": "image_url", "image_url": {"url": url}}


INV = (InvalidRequest, "invalid_request")
UNS = (UnsupportedField, "unsupported_field")

ERROR_ROWS: list[tuple[str, Any, tuple[type, str], str | None]] = [
    # body / allow-list
    ("body-array", [1], INV, None),
    ("body-string", "x", INV, None),
    ("body-null", None, INV, None),
    ("unknown-key", body(foo=1), UNS, "foo"),
    ("unknown-first-sorted", body(zeta=1, alpha=2), UNS, "alpha"),
    ("unknown-null-still-unknown", body(foo=None), UNS, "foo"),
    ("functions", body(functions=[]), UNS, "functions"),
    ("function_call", body(function_call="auto"), UNS, "function_call"),
    *[
        (f"rejected-{k}", body(**{k: 1}), UNS, k)
        for k in (
            "modalities",
            "audio",
            "metadata",
            "store",
            "service_tier",
            "prediction",
            "reasoning_effort",
            "verbosity",
        )
    ],
    # model
    ("model-missing", body(model=DROP), INV, "model"),
    ("model-null", body(model=None), INV, "model"),
    ("model-empty", body(model=""), INV, "model"),
    ("model-int", body(model=5), INV, "model"),
    # messages
    ("messages-missing", body(messages=DROP), INV, "messages"),
    ("messages-empty", body(messages=[]), INV, "messages"),
    ("messages-object", body(messages={"role": "user"}), INV, "messages"),
    ("message-not-object", msgs(user("a"), 5), INV, "messages[1]"),
    ("role-missing", msgs({"content": "x"}), INV, "messages[0].role"),
    ("role-int", msgs({"role": 1, "content": "x"}), INV, "messages[0].role"),
    ("role-unknown", msgs({"role": "bot", "content": "x"}), INV, "messages[0].role"),
    ("content-null-user", msgs(user(None)), INV, "messages[0].content"),
    ("content-missing-user", msgs({"role": "user"}), INV, "messages[0].content"),
    ("content-null-assistant-no-calls", msgs({"role": "assistant", "content": None}), INV, "messages[0].content"),
    ("content-int", msgs(user(5)), INV, "messages[0].content"),
    ("content-object", msgs(user({"type": "text"})), INV, "messages[0].content"),
    ("part-not-object", msgs(user(["x"])), INV, "messages[0].content[0]"),
    ("part-type-missing", msgs(user([{"text": "x"}])), INV, "messages[0].content[0].type"),
    ("part-type-int", msgs(user([{"type": 1}])), INV, "messages[0].content[0].type"),
    ("part-text-not-string", msgs(user([{"type": "text", "text": 1}])), INV, "messages[0].content[0].text"),
    ("part-input-text-missing", msgs(user([{"type": "input_text"}])), INV, "messages[0].content[0].text"),
    (
        "part-video",
        msgs(user([{"type": "text", "text": "a"}, {"type": "video_url"}])),
        UNS,
        "messages[0].content[1].type",
    ),
    ("part-audio", msgs(user([{"type": "audio_url"}])), UNS, "messages[0].content[0].type"),
    ("image-remote-url", msgs(user([image("https://example.com/a.png")])), INV, "messages[0].content[0].image_url.url"),
    (
        "image-remote-string",
        msgs(user([{"type": "input_image", "image_url": "http://x/a.png"}])),
        INV,
        "messages[0].content[0].image_url",
    ),
    ("image-missing-payload", msgs(user([{"type": "image_url"}])), INV, "messages[0].content[0].image_url"),
    ("image-url-not-string", msgs(user([image(5)])), INV, "messages[0].content[0].image_url.url"),
    ("image-not-base64", msgs(user([image("data:image/png;base64,@@@")])), INV, "messages[0].content[0].image_url.url"),
    ("image-no-base64-flag", msgs(user([image("data:image/png,abcd")])), INV, "messages[0].content[0].image_url.url"),
    (
        "image-non-image-mime",
        msgs(user([image("data:text/plain;base64,aGk=")])),
        INV,
        "messages[0].content[0].image_url.url",
    ),
    ("image-empty", msgs(user([image("data:image/png;base64,")])), INV, "messages[0].content[0].image_url.url"),
    ("image-17th", msgs(user([image(PNG_URI)] * 10), user([image(PNG_URI)] * 7)), INV, "messages[1].content[6]"),
    (
        "tool-call-id-on-user",
        msgs({"role": "user", "content": "x", "tool_call_id": "c"}),
        INV,
        "messages[0].tool_call_id",
    ),
    ("tool-call-id-missing", msgs({"role": "tool", "content": "x"}), INV, "messages[0].tool_call_id"),
    ("tool-call-id-empty", msgs({"role": "tool", "content": "x", "tool_call_id": ""}), INV, "messages[0].tool_call_id"),
    ("tool-calls-on-user", msgs({"role": "user", "content": "x", "tool_calls": [CALL]}), INV, "messages[0].tool_calls"),
    (
        "tool-calls-not-array",
        msgs({"role": "assistant", "content": None, "tool_calls": CALL}),
        INV,
        "messages[0].tool_calls",
    ),
    (
        "tool-call-id-field-missing",
        msgs({"role": "assistant", "tool_calls": [{k: v for k, v in CALL.items() if k != "id"}]}),
        INV,
        "messages[0].tool_calls[0].id",
    ),
    (
        "tool-call-type",
        msgs({"role": "assistant", "tool_calls": [{**CALL, "type": "fn"}]}),
        INV,
        "messages[0].tool_calls[0].type",
    ),
    (
        "tool-call-extra-key",
        msgs({"role": "assistant", "tool_calls": [{**CALL, "x": 1}]}),
        INV,
        "messages[0].tool_calls[0].x",
    ),
    (
        "tool-call-name-empty",
        msgs({"role": "assistant", "tool_calls": [{**CALL, "function": {"name": "", "arguments": ""}}]}),
        INV,
        "messages[0].tool_calls[0].function.name",
    ),
    (
        "tool-call-arguments-object",
        msgs(
            user("q"),
            {
                "role": "assistant",
                "content": None,
                "tool_calls": [{**CALL, "function": {"name": "f", "arguments": {}}}],
            },
        ),
        INV,
        "messages[1].tool_calls[0].function.arguments",
    ),
    (
        "tool-call-arguments-not-json",
        msgs(
            user("q"),
            {
                "role": "assistant",
                "content": None,
                "tool_calls": [CALL, {**CALL, "id": "call_2", "function": {"name": "f", "arguments": "{city: Paris"}}],
            },
        ),
        INV,
        "messages[1].tool_calls[1].function.arguments",
    ),
    # token caps
    *[
        (f"{field}-{label}", body(**{field: value}), INV, field)
        for field in ("max_completion_tokens", "max_tokens")
        for label, value in (
            ("string", "16"),
            ("negative", -1),
            ("float", 1.5),
            ("zero", 0),
            ("bool", True),
            ("too-big", 2**32),
        )
    ],
    # sampler fields
    ("temperature-negative", body(temperature=-0.1), INV, "temperature"),
    ("temperature-string", body(temperature="1"), INV, "temperature"),
    ("temperature-bool", body(temperature=True), INV, "temperature"),
    ("temperature-inf", body(temperature=float("inf")), INV, "temperature"),
    ("temperature-nan", body(temperature=float("nan")), INV, "temperature"),
    ("top_p-zero", body(top_p=0), INV, "top_p"),
    ("top_p-over-one", body(top_p=1.01), INV, "top_p"),
    ("top_k-zero", body(top_k=0), INV, "top_k"),
    ("top_k-float", body(top_k=1.5), INV, "top_k"),
    ("repetition_penalty-zero", body(repetition_penalty=0), INV, "repetition_penalty"),
    ("repetition_penalty-over-two", body(repetition_penalty=2.5), INV, "repetition_penalty"),
    ("min_tokens-negative", body(min_tokens=-1), INV, "min_tokens"),
    ("min_tokens-float", body(min_tokens=1.0), INV, "min_tokens"),
    ("frequency_penalty-range", body(frequency_penalty=2.5), INV, "frequency_penalty"),
    ("presence_penalty-range", body(presence_penalty=-3), INV, "presence_penalty"),
    ("presence_penalty-string", body(presence_penalty="1"), INV, "presence_penalty"),
    ("stop-int", body(stop=5), INV, "stop"),
    ("stop-non-string-entry", body(stop=["a", 5]), INV, "stop"),
    ("stop-empty-entry", body(stop=["a", ""]), INV, "stop"),
    ("stop-empty-string", body(stop=""), INV, "stop"),
    ("stop-33-entries", body(stop=[f"s{i}" for i in range(33)]), INV, "stop"),
    ("stop-entry-over-256-chars", body(stop=["x" * 257]), INV, "stop"),
    ("n-zero", body(n=0), INV, "n"),
    ("n-too-big", body(n=129), INV, "n"),
    ("n-float", body(n=1.5), INV, "n"),
    ("best_of-zero", body(best_of=0), INV, "best_of"),
    ("best_of-too-big", body(best_of=129), INV, "best_of"),
    ("best_of-less-than-n", body(n=3, best_of=2), INV, "best_of"),
    ("best_of-with-stream", body(best_of=2, stream=True), UNS, "best_of"),
    ("seed-too-big", body(seed=2**63), INV, "seed"),
    ("seed-too-small", body(seed=-(2**63) - 1), INV, "seed"),
    ("seed-float", body(seed=1.5), INV, "seed"),
    ("seed-bool", body(seed=True), INV, "seed"),
    ("seed-string", body(seed="1"), INV, "seed"),
    ("logprobs-string", body(logprobs="yes"), INV, "logprobs"),
    ("top_logprobs-range", body(logprobs=True, top_logprobs=21), INV, "top_logprobs"),
    ("top_logprobs-without-logprobs", body(top_logprobs=5), INV, "top_logprobs"),
    ("top_logprobs-logprobs-false", body(logprobs=False, top_logprobs=1), INV, "top_logprobs"),
    ("logit_bias-array", body(logit_bias=[]), INV, "logit_bias"),
    ("logit_bias-key", body(logit_bias={"abc": 1}), INV, "logit_bias"),
    ("logit_bias-value-range", body(logit_bias={"1": 101}), INV, "logit_bias"),
    ("logit_bias-value-type", body(logit_bias={"1": "x"}), INV, "logit_bias"),
    ("logit_bias-value-bool", body(logit_bias={"1": True}), INV, "logit_bias"),
    ("logit_bias-too-many", body(logit_bias={str(i): 1 for i in range(1025)}), INV, "logit_bias"),
    ("stream-string", body(stream="true"), INV, "stream"),
    ("stream-int", body(stream=1), INV, "stream"),
    ("stream_options-type", body(stream_options=5), INV, "stream_options"),
    ("stream_options-include_usage", body(stream_options={"include_usage": "y"}), INV, "stream_options.include_usage"),
    ("stream_options-unknown", body(stream_options={"foo": 1}), UNS, "stream_options.foo"),
    # tools
    ("tools-empty", body(tools=[]), INV, "tools"),
    ("tools-too-many", body(tools=[TOOL] * 65), INV, "tools"),
    ("tools-string", body(tools="x"), INV, "tools"),
    ("tool-not-object", body(tools=[5]), INV, "tools[0]"),
    ("tool-type", body(tools=[{**TOOL, "type": "code"}]), INV, "tools[0].type"),
    # an unknown key inside a tool definition is a deviation of the tool (invalid_request), not of the body
    ("tool-unknown-key", body(tools=[{**TOOL, "foo": 1}]), INV, "tools[0].foo"),
    ("tool-function-unknown-key", body(tools=[{"type": "function", "function": {"name": "f", "foo": 1}}]), INV,
     "tools[0].function.foo"),
    ("tool-function-missing", body(tools=[{"type": "function"}]), INV, "tools[0].function"),
    ("tool-name-empty", body(tools=[{"type": "function", "function": {"name": ""}}]), INV, "tools[0].function.name"),
    (
        "tool-description-type",
        body(tools=[{"type": "function", "function": {"name": "f", "description": 1}}]),
        INV,
        "tools[0].function.description",
    ),
    (
        "tool-parameters-type",
        body(tools=[{"type": "function", "function": {"name": "f", "parameters": []}}]),
        INV,
        "tools[0].function.parameters",
    ),
    (
        "tool-parameters-forbidden-keyword",
        body(tools=[{"type": "function", "function": {"name": "f", "parameters": {"if": {}}}}]),
        UNS,
        "tools[0].function.parameters",
    ),
    ("tool_choice-without-tools", body(tool_choice="auto"), INV, "tool_choice"),
    ("tool_choice-bad-string", body(tools=[TOOL], tool_choice="sometimes"), INV, "tool_choice"),
    ("tool_choice-bad-object", body(tools=[TOOL], tool_choice={"type": "function"}), INV, "tool_choice"),
    (
        "tool_choice-unknown-function",
        body(tools=[TOOL], tool_choice={"type": "function", "function": {"name": "nope"}}),
        INV,
        "tool_choice",
    ),
    (
        "tool_choice-required-with-json",
        body(tools=[TOOL], tool_choice="required", response_format={"type": "json_object"}),
        INV,
        "tool_choice",
    ),
    (
        "tool_choice-named-with-schema",
        body(
            tools=[TOOL],
            tool_choice={"type": "function", "function": {"name": "get_weather"}},
            response_format={"type": "json_schema", "json_schema": {"schema": {}}},
        ),
        INV,
        "tool_choice",
    ),
    ("parallel_tool_calls-type", body(parallel_tool_calls="yes"), INV, "parallel_tool_calls"),
    # response_format
    ("response_format-string", body(response_format="json"), INV, "response_format"),
    ("response_format-type-missing", body(response_format={}), INV, "response_format.type"),
    ("response_format-type-int", body(response_format={"type": 1}), INV, "response_format.type"),
    ("response_format-type-other", body(response_format={"type": "regex"}), UNS, "response_format.type"),
    ("response_format-unknown-key", body(response_format={"type": "text", "x": 1}), UNS, "response_format.x"),
    (
        "response_format-json_schema-missing",
        body(response_format={"type": "json_schema"}),
        INV,
        "response_format.json_schema",
    ),
    (
        "response_format-schema-missing",
        body(response_format={"type": "json_schema", "json_schema": {"name": "n"}}),
        INV,
        "response_format.json_schema.schema",
    ),
    (
        "response_format-schema-not-object",
        body(response_format={"type": "json_schema", "json_schema": {"schema": "x"}}),
        INV,
        "response_format.json_schema.schema",
    ),
    (
        "response_format-json_schema-unknown-key",
        body(response_format={"type": "json_schema", "json_schema": {"schema": {}, "y": 1}}),
        UNS,
        "response_format.json_schema.y",
    ),
    (
        "response_format-schema-external-ref",
        body(response_format={"type": "json_schema", "json_schema": {"schema": {"$ref": "https://x/s.json"}}}),
        UNS,
        "response_format.json_schema.schema",
    ),
    (
        "response_format-schema-unresolved-ref",
        body(response_format={"type": "json_schema", "json_schema": {"schema": {"$ref": "#/$defs/x"}}}),
        INV,
        "response_format.json_schema.schema",
    ),
    # chat_template_kwargs
    ("chat_template_kwargs-type", body(chat_template_kwargs=[]), INV, "chat_template_kwargs"),
    ("chat_template_kwargs-unknown", body(chat_template_kwargs={"foo": 1}), UNS, "chat_template_kwargs.foo"),
    (
        "enable_thinking-type",
        body(chat_template_kwargs={"enable_thinking": "y"}),
        INV,
        "chat_template_kwargs.enable_thinking",
    ),
    (
        "risk_name-empty",
        body(chat_template_kwargs={"guardian_config": {"risk_name": ""}}),
        INV,
        "chat_template_kwargs.guardian_config.risk_name",
    ),
    (
        "risk_name-too-long",
        body(chat_template_kwargs={"guardian_config": {"risk_name": "r" * 129}}),
        INV,
        "chat_template_kwargs.guardian_config.risk_name",
    ),
    (
        "guardian_config-unknown",
        body(chat_template_kwargs={"guardian_config": {"risk_name": "harm", "x": 1}}),
        UNS,
        "chat_template_kwargs.guardian_config.x",
    ),
    # SIE extensions and pass-through strings
    ("include_reasoning-type", body(include_reasoning="yes"), INV, "include_reasoning"),
    ("user-type", body(user=5), INV, "user"),
    ("safety_identifier-type", body(safety_identifier=5), INV, "safety_identifier"),
    ("prompt_cache_key-type", body(prompt_cache_key=5), INV, "prompt_cache_key"),
    ("routing_key-type", body(routing_key=[]), INV, "routing_key"),
    ("lora_adapter-empty", body(lora_adapter=""), INV, "lora_adapter"),
    ("lora_adapter-type", body(lora_adapter=1), INV, "lora_adapter"),
]


@pytest.mark.parametrize(
    ("payload", "expected", "param"),
    [pytest.param(p, e, q, id=i) for i, p, e, q in ERROR_ROWS],
)
def test_rejects(payload: Any, expected: tuple[type, str], param: str | None) -> None:
    cls, code = expected
    with pytest.raises(GatewayError) as info:
        parse_chat_request(payload)
    err = info.value
    assert type(err) is cls
    assert (err.status, err.code, err.param) == (400, code, param)
    assert "pydantic" not in err.message.lower() and "Input should" not in err.message


def test_rejected_field_messages() -> None:
    with pytest.raises(UnsupportedField) as info:
        parse_chat_request(body(functions=[]))
    assert "deprecated by OpenAI; use 'tools' / 'tool_choice'" in info.value.message
    with pytest.raises(InvalidRequest) as bad:
        parse_chat_request([])
    assert bad.value.message == "request body must be a JSON object"


def test_image_over_16_mib_rejected() -> None:
    big = "data:image/png;base64," + base64.b64encode(b"\0" * (16 * 1024 * 1024 + 1)).decode()
    with pytest.raises(InvalidRequest) as info:
        parse_chat_request(msgs(user([image(big)])))
    assert info.value.param == "messages[0].content[0].image_url.url"


def parse(**changes: Any) -> GenerationRequest:
    return parse_chat_request(body(**changes))


def test_minimal_request_defaults() -> None:
    req = parse()
    assert req.model == "org/model"
    assert req.messages == ({"role": "user", "content": "hi"},)
    assert (req.max_tokens, req.max_tokens_param) == (1024, "max_completion_tokens")
    assert (req.stream, req.include_usage, req.n, req.logprobs, req.top_logprobs) == (False, False, 1, False, 0)
    assert req.grammar is None and req.images == () and req.stop == () and req.prompt is None


def test_default_max_tokens_comes_from_the_setting() -> None:
    req = parse_chat_request(body(), default_max_tokens=77)
    assert (req.max_tokens, req.max_tokens_param) == (77, "max_completion_tokens")


def test_max_completion_tokens_wins_over_max_tokens() -> None:
    req = parse(max_tokens=10, max_completion_tokens=20)
    assert (req.max_tokens, req.max_tokens_param) == (20, "max_completion_tokens")
    req = parse(max_tokens=10)
    assert (req.max_tokens, req.max_tokens_param) == (10, "max_tokens")
    assert parse(max_tokens=2**32 - 1).max_tokens == 2**32 - 1


def test_null_means_absent_for_every_optional_field() -> None:
    optional = [
        "max_completion_tokens",
        "max_tokens",
        "temperature",
        "top_p",
        "top_k",
        "repetition_penalty",
        "min_tokens",
        "frequency_penalty",
        "presence_penalty",
        "stop",
        "n",
        "best_of",
        "seed",
        "logprobs",
        "top_logprobs",
        "logit_bias",
        "stream",
        "stream_options",
        "tools",
        "tool_choice",
        "parallel_tool_calls",
        "response_format",
        "chat_template_kwargs",
        "include_reasoning",
        "user",
        "safety_identifier",
        "prompt_cache_key",
        "routing_key",
        "lora_adapter",
    ]
    assert parse(**{k: None for k in optional}) == parse()
    assert parse(stream=True, stream_options={"include_usage": None}).include_usage is False


def test_developer_becomes_system_and_name_is_ignored() -> None:
    req = parse_chat_request(
        msgs(
            {"role": "developer", "content": "be brief", "name": "ops"},
            {"role": "user", "content": "hi", "name": "bob"},
        )
    )
    assert req.messages == ({"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"})


def test_tool_replay_messages() -> None:
    req = parse_chat_request(
        msgs(
            user("weather?"),
            {"role": "assistant", "content": None, "tool_calls": [CALL]},
            {"role": "tool", "content": "sunny", "tool_call_id": "call_1"},
        )
    )
    assert req.messages == (
        {"role": "user", "content": "weather?"},
        {"role": "assistant", "content": None, "tool_calls": [CALL]},
        {"role": "tool", "content": "sunny", "tool_call_id": "call_1"},
    )


def test_text_parts_concatenate_and_images_decode_in_message_order() -> None:
    req = parse_chat_request(
        msgs(
            user([{"type": "text", "text": "a"}, image(PNG_URI), {"type": "input_text", "text": "b"}]),
            user([{"type": "input_image", "image_url": JPEG_URI}]),
        )
    )
    assert req.messages is not None
    assert [m["content"] for m in req.messages] == ["ab", ""]
    assert req.images == (ImageInput(PNG, "png"), ImageInput(b"\xff\xd8\xff\xe0", "jpeg"))
    assert req.image_param == "messages[0].content[1].type"


def test_sixteen_images_allowed() -> None:
    assert len(parse_chat_request(msgs(user([image(PNG_URI)] * 16))).images) == 16


@pytest.mark.parametrize(
    ("response_format", "grammar"),
    [
        ({"type": "text"}, None),
        ({"type": "json_object"}, GrammarSpec(kind="json_object", value={"type": "object"}, label="json_object",
                                                 param="response_format")),
        (
            {"type": "json_schema", "json_schema": {"name": "pt", "strict": True, "schema": {"type": "object"}}},
            GrammarSpec(kind="json_schema", value={"type": "object"}, label="pt", strict=True,
                        param="response_format"),
        ),
        (
            {
                "type": "json_schema",
                "json_schema": {
                    "schema": {"$defs": {"n": {"type": "integer"}}, "properties": {"x": {"$ref": "#/$defs/n"}}}
                },
            },
            GrammarSpec(kind="json_schema", value={"properties": {"x": {"type": "integer"}}}, param="response_format"),
        ),
    ],
)
def test_response_format_grammar(response_format: dict[str, Any], grammar: Any) -> None:
    assert parse(response_format=response_format).grammar == grammar


def test_user_and_safety_identifier_are_dropped() -> None:
    """`user` only reaches admission (with auth off it names the fair-share tenant, as a keyed hash): never the wire,
    never a repr."""
    req = parse(user="alice@example.com", safety_identifier="sid-42")
    assert dataclasses.replace(req, user=None) == parse()
    assert "alice" not in repr(req) and "sid-42" not in repr(req)
    assert "alice" not in str(req.sampling_parameters())


def test_sampler_fields_and_hints_are_carried() -> None:
    req = parse(
        temperature=0,
        top_p=1,
        top_k=40,
        repetition_penalty=2,
        min_tokens=3,
        frequency_penalty=-2,
        presence_penalty=2,
        seed=-(2**63),
        n=2,
        best_of=2,
        stop="END",
        logit_bias={"42": -100, "7": 1.5},
        logprobs=True,
        top_logprobs=20,
        lora_adapter="sql",
        routing_key="r",
        prompt_cache_key="p",
        include_reasoning=True,
        parallel_tool_calls=False,
        chat_template_kwargs={"enable_thinking": False, "guardian_config": {"risk_name": "harm"}},
    )
    assert (req.temperature, req.top_p, req.top_k, req.repetition_penalty) == (0, 1, 40, 2)
    assert isinstance(req.temperature, float)
    assert (req.min_tokens, req.frequency_penalty, req.presence_penalty) == (3, -2, 2)
    assert (req.seed, req.n, req.best_of, req.stop) == (-(2**63), 2, 2, ("END",))
    assert req.logit_bias == {42: -100.0, 7: 1.5}
    assert (req.logprobs, req.top_logprobs, req.lora_adapter) == (True, 20, "sql")
    assert (req.routing_key, req.prompt_cache_key, req.include_reasoning) == ("r", "p", True)
    assert req.parallel_tool_calls is False
    assert req.chat_template_kwargs == {"enable_thinking": False, "guardian_config": {"risk_name": "harm"}}


def test_stop_and_logit_bias_empty_mean_absent() -> None:
    req = parse(stop=[], logit_bias={})
    assert (req.stop, req.logit_bias) == ((), None)
    assert parse(stop=["a", "b"]).stop == ("a", "b")


def test_include_usage_only_when_streaming() -> None:
    assert parse(stream=True, stream_options={"include_usage": True}).include_usage is True
    assert parse(stream=False, stream_options={"include_usage": True}).include_usage is False


def test_tools_and_tool_choice() -> None:
    named = {"type": "function", "function": {"name": "get_weather"}}
    req = parse(tools=[TOOL], tool_choice=named)
    assert req.tools == (TOOL,)
    assert req.tool_choice == named
    for choice in ("auto", "none", "required"):
        assert parse(tools=[TOOL], tool_choice=choice).tool_choice == choice
    # A forcing choice with a text response_format is fine.
    assert parse(tools=[TOOL], tool_choice="required", response_format={"type": "text"}).grammar is None


# ---- property: any JSON value in any field never escapes as another exception ----------------

FIELDS = [
    "model",
    "messages",
    "max_completion_tokens",
    "max_tokens",
    "temperature",
    "top_p",
    "top_k",
    "repetition_penalty",
    "min_tokens",
    "frequency_penalty",
    "presence_penalty",
    "stop",
    "n",
    "best_of",
    "seed",
    "logprobs",
    "top_logprobs",
    "logit_bias",
    "stream",
    "stream_options",
    "tools",
    "tool_choice",
    "parallel_tool_calls",
    "response_format",
    "chat_template_kwargs",
    "include_reasoning",
    "user",
    "safety_identifier",
    "prompt_cache_key",
    "routing_key",
    "lora_adapter",
]
ODD_VALUES: list[Any] = [
    None,
    True,
    False,
    0,
    -1,
    1,
    2,
    1.5,
    -0.0,
    2**64,
    -(2**64),
    float("inf"),
    "",
    "x",
    "auto",
    [],
    [None],
    [1],
    ["a", ""],
    [{}],
    [{"role": "user"}],
    [{"role": "tool", "content": []}],
    {},
    {"a": 1},
    {"type": "function"},
    {"type": "json_schema"},
    {"include_usage": 1},
    {"guardian_config": {}},
    {"1": 1},
    [TOOL],
    {"$ref": "#"},
]


@pytest.mark.parametrize("field", FIELDS)
def test_odd_values_in_every_field(field: str) -> None:
    for value in ODD_VALUES:
        check_any_value(parse_chat_request, body, field, value)


@settings(max_examples=400, deadline=None)
@given(field=st.sampled_from(FIELDS), value=JSON_VALUES)
def test_any_json_value_in_any_field(field: str, value: Any) -> None:
    check_any_value(parse_chat_request, body, field, value)


def test_stop_at_its_bounds_is_accepted():
    from gateway.contracts.common import MAX_STOP_LENGTH, MAX_STOP_SEQUENCES

    stops = [f"{i:03d}" + "x" * (MAX_STOP_LENGTH - 3) for i in range(MAX_STOP_SEQUENCES)]
    req = parse_chat_request(body(stop=stops))
    assert list(req.stop) == stops
