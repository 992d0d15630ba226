"""Checks of validated requests against a model profile: one row per rule."""

from __future__ import annotations

import base64
from typing import Any

import pytest

from gateway.contracts.chat import parse_chat_request
from gateway.contracts.generate import parse_generate_request
from gateway.contracts.profile_checks import check_against_profile
from gateway.contracts.responses import parse_responses_request
from gateway.domain import GenerationRequest
from gateway.errors import (
    ContextExceeded,
    GatewayError,
    InvalidRequest,
    UnknownLoraAdapter,
    UnsupportedField,
)
from gateway.profile import ModelProfile

PNG_B64 = base64.b64encode(b"\x89PNG\r\n\x1a\n").decode()

PLAIN = ModelProfile(name="org/plain", triton_model="plain", max_output_tokens=512)
FULL = ModelProfile(
    name="org/full",
    triton_model="full",
    max_output_tokens=4096,
    lora_adapters=frozenset({"sql"}),
    image_input=True,
    grammar_kinds=frozenset({"json_schema", "regex", "ebnf"}),
)
REGEX_ONLY = ModelProfile(name="org/re", triton_model="re", grammar_kinds=frozenset({"regex"}))
NO_STREAM = ModelProfile(name="org/batch", triton_model="batch", streaming=False)


def chat(**fields: Any) -> GenerationRequest:
    messages = fields.pop("messages", [{"role": "user", "content": "hi"}])
    return parse_chat_request({"model": "m", "messages": messages, **fields})


def native(**fields: Any) -> GenerationRequest:
    return parse_generate_request({"prompt": "p", "max_new_tokens": 16, **fields}, "m")


IMAGE_MESSAGES = [
    {"role": "system", "content": "s"},
    {
        "role": "user",
        "content": [
            {"type": "text", "text": "what?"},
            {"type": "image_url", "image_url": {"url": f"data:image/png;base64,{PNG_B64}"}},
        ],
    },
]

ERROR_ROWS: list[tuple[str, GenerationRequest, ModelProfile, type, str, str]] = [
    (
        "lora-unknown-native",
        native(lora_adapter="nope"),
        FULL,
        UnknownLoraAdapter,
        "unknown_lora_adapter",
        "lora_adapter",
    ),
    ("lora-unknown-chat", chat(lora_adapter="sql"), PLAIN, UnknownLoraAdapter, "unknown_lora_adapter", "lora_adapter"),
    ("stream-not-supported", native(stream=True), NO_STREAM, UnsupportedField, "unsupported_field", "stream"),
    ("images-native", native(images=[{"data": PNG_B64}]), PLAIN, UnsupportedField, "unsupported_field", "images"),
    (
        "images-chat",
        chat(messages=IMAGE_MESSAGES),
        PLAIN,
        UnsupportedField,
        "unsupported_field",
        "messages[1].content[1].type",
    ),
    (
        "grammar-native-regex",
        native(grammar={"regex": "a"}),
        PLAIN,
        UnsupportedField,
        "unsupported_field",
        "grammar.regex",
    ),
    (
        "grammar-native-json_schema",
        native(grammar={"json_schema": {}}),
        REGEX_ONLY,
        UnsupportedField,
        "unsupported_field",
        "grammar.json_schema",
    ),
    (
        "grammar-chat-json_object",
        chat(response_format={"type": "json_object"}),
        REGEX_ONLY,
        UnsupportedField,
        "unsupported_field",
        "response_format",
    ),
    (
        "grammar-chat-json_schema",
        chat(response_format={"type": "json_schema", "json_schema": {"schema": {}}}),
        PLAIN,
        UnsupportedField,
        "unsupported_field",
        "response_format",
    ),
    (
        "max-new-tokens-over-cap",
        native(max_new_tokens=513),
        PLAIN,
        ContextExceeded,
        "context_exceeded",
        "max_new_tokens",
    ),
    (
        "max-completion-tokens-over-cap",
        chat(max_completion_tokens=600, max_tokens=10),
        PLAIN,
        ContextExceeded,
        "context_exceeded",
        "max_completion_tokens",
    ),
    ("max-tokens-over-cap", chat(max_tokens=600), PLAIN, ContextExceeded, "context_exceeded", "max_tokens"),
    ("default-max-tokens-over-cap", chat(), PLAIN, ContextExceeded, "context_exceeded", "max_completion_tokens"),
    ("min-tokens-over-max", chat(max_tokens=10, min_tokens=11), FULL, InvalidRequest, "invalid_request", "min_tokens"),
]


@pytest.mark.parametrize(
    ("req", "profile", "cls", "code", "param"),
    [pytest.param(*row[1:], id=row[0]) for row in ERROR_ROWS],
)
def test_rejects(req: GenerationRequest, profile: ModelProfile, cls: type, code: str, param: str) -> None:
    with pytest.raises(GatewayError) as info:
        check_against_profile(req, profile)
    err = info.value
    assert type(err) is cls
    assert (err.status, err.code, err.param) == (400, code, param)


def test_context_exceeded_type() -> None:
    with pytest.raises(ContextExceeded) as info:
        check_against_profile(native(max_new_tokens=513), PLAIN)
    assert info.value.type == "context_length_exceeded"
    assert "512" in info.value.message


ACCEPTED: list[tuple[str, GenerationRequest, ModelProfile]] = [
    ("plain-native", native(), PLAIN),
    ("plain-chat", chat(max_tokens=512), PLAIN),
    ("cap-exact", native(max_new_tokens=4096), FULL),
    ("lora-known", chat(lora_adapter="sql"), FULL),
    ("images-native", native(images=[{"data": PNG_B64}]), FULL),
    ("images-chat", chat(messages=IMAGE_MESSAGES), FULL),
    ("grammar-native", native(grammar={"ebnf": "root ::= 'a'"}), FULL),
    ("grammar-chat-json_object", chat(response_format={"type": "json_object"}), FULL),
    ("response-format-text", chat(max_tokens=1, response_format={"type": "text"}), PLAIN),
    ("min-tokens-equal", chat(max_tokens=10, min_tokens=10), FULL),
    ("stream", native(stream=True), FULL),
]


@pytest.mark.parametrize(("req", "profile"), [pytest.param(*r[1:], id=r[0]) for r in ACCEPTED])
def test_accepts(req: GenerationRequest, profile: ModelProfile) -> None:
    check_against_profile(req, profile)  # no exception: accepted


def test_lora_checked_before_output_cap() -> None:
    with pytest.raises(UnknownLoraAdapter):
        check_against_profile(native(lora_adapter="x", max_new_tokens=10_000), PLAIN)


@pytest.mark.parametrize(("req", "asked", "param"), [
    (chat(response_format={"type": "json_object"}), "json_object", "response_format"),
    (chat(response_format={"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "object"}}}),
     "json_schema", "response_format"),
    (parse_responses_request({"model": "m", "input": "hi", "text": {"format": {"type": "json_object"}}},
                             default_max_tokens=16).generation_request(), "json_object", "text.format"),
    (native(grammar={"json_schema": {"type": "object"}}), "json_schema", "grammar.json_schema"),
])
def test_an_unsupported_grammar_names_what_the_client_asked_for_in_its_own_field(req, asked, param) -> None:
    with pytest.raises(UnsupportedField) as info:
        check_against_profile(req, REGEX_ONLY)
    assert info.value.param == param
    assert info.value.message == f"model 'org/re' does not support '{asked}' constrained output"
