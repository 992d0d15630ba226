"""Native generate contract: one row per rule (exact class, status, code, param) plus mappings."""

from __future__ import annotations

import base64
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from gateway.contracts.generate import parse_generate_request
from gateway.domain import GenerationRequest, GrammarSpec, ImageInput
from gateway.errors import GatewayError, InvalidRequest, UnsupportedField
from gateway.openapi_doc import build_openapi
from tests.unit.any_value import JSON_VALUES, check_any_value

DROP = object()
MODEL = "org__model"
PNG = b"\x89PNG\r\n\x1a\n" + b"\x01" * 5
PNG_B64 = base64.b64encode(PNG).decode()


def body(**changes: Any) -> dict[str, Any]:
    out: dict[str, Any] = {"prompt": "Once upon a time", "max_new_tokens": 16}
    for key, value in changes.items():
        if value is DROP:
            out.pop(key, None)
        else:
            out[key] = value
    return out


def nested(depth: int) -> dict[str, Any]:
    schema: dict[str, Any] = {"type": "string"}
    for _ in range(depth):
        schema = {"type": "array", "items": schema}
    return schema


INV = (InvalidRequest, "invalid_request")
UNS = (UnsupportedField, "unsupported_field")

ERROR_ROWS: list[tuple[str, Any, tuple[type, str], str | None]] = [
    ("body-array", [], INV, None),
    ("body-number", 3, INV, None),
    ("unknown-key", body(messages=[]), UNS, "messages"),
    ("unknown-first-sorted", body(zz=1, model="m"), UNS, "model"),
    ("prompt-missing", body(prompt=DROP), INV, "prompt"),
    ("prompt-empty", body(prompt=""), INV, "prompt"),
    ("prompt-int", body(prompt=1), INV, "prompt"),
    ("max_new_tokens-missing", body(max_new_tokens=DROP), INV, "max_new_tokens"),
    ("max_new_tokens-zero", body(max_new_tokens=0), INV, "max_new_tokens"),
    ("max_new_tokens-float", body(max_new_tokens=1.5), INV, "max_new_tokens"),
    ("max_new_tokens-bool", body(max_new_tokens=True), INV, "max_new_tokens"),
    ("max_new_tokens-string", body(max_new_tokens="16"), INV, "max_new_tokens"),
    # images
    ("images-empty", body(images=[]), INV, "images"),
    ("images-too-many", body(images=[{"data": PNG_B64}] * 17), INV, "images"),
    ("images-object", body(images={"data": PNG_B64}), INV, "images"),
    ("image-not-object", body(images=[{"data": PNG_B64}, "x"]), INV, "images[1]"),
    ("image-unknown-key", body(images=[{"data": PNG_B64}, {"data": PNG_B64, "url": "x"}]), UNS, "images[1].url"),
    ("image-data-missing", body(images=[{"format": "png"}]), INV, "images[0].data"),
    ("image-data-int", body(images=[{"data": 5}]), INV, "images[0].data"),
    ("image-data-not-base64", body(images=[{"data": "@@@@"}]), INV, "images[0].data"),
    (
        "image-data-urlsafe",
        body(images=[{"data": base64.urlsafe_b64encode(b"\xfb\xff").decode()}]),
        INV,
        "images[0].data",
    ),
    ("image-data-non-canonical", body(images=[{"data": "iVBORw0KGgp="}]), INV, "images[0].data"),
    ("image-data-unpadded", body(images=[{"data": PNG_B64.rstrip("=")}]), INV, "images[0].data"),
    ("image-data-empty", body(images=[{"data": ""}]), INV, "images[0].data"),
    ("image-format-empty", body(images=[{"data": PNG_B64, "format": ""}]), INV, "images[0].format"),
    ("image-format-chars", body(images=[{"data": PNG_B64, "format": "p n g"}]), INV, "images[0].format"),
    ("image-format-long", body(images=[{"data": PNG_B64, "format": "x" * 33}]), INV, "images[0].format"),
    ("image-format-int", body(images=[{"data": PNG_B64, "format": 1}]), INV, "images[0].format"),
    # sampler fields
    ("temperature-negative", body(temperature=-1), INV, "temperature"),
    ("temperature-bool", body(temperature=False), INV, "temperature"),
    ("temperature-inf", body(temperature=float("inf")), INV, "temperature"),
    ("top_p-zero", body(top_p=0), INV, "top_p"),
    ("top_p-over", body(top_p=1.5), INV, "top_p"),
    ("stop-bare-string", body(stop="END"), INV, "stop"),
    ("stop-non-string", body(stop=["a", 1]), INV, "stop"),
    ("stop-empty-entry", body(stop=[""]), INV, "stop"),
    ("stop-33-entries", body(stop=[f"s{i}" for i in range(33)]), INV, "stop"),
    ("stop-entry-over-256-chars", body(stop=["x" * 257]), INV, "stop"),
    ("frequency_penalty-range", body(frequency_penalty=-2.1), INV, "frequency_penalty"),
    ("presence_penalty-type", body(presence_penalty="0"), INV, "presence_penalty"),
    ("seed-too-big", body(seed=2**63), INV, "seed"),
    ("seed-float", body(seed=3.0), INV, "seed"),
    ("seed-bool", body(seed=False), INV, "seed"),
    ("logit_bias-key", body(logit_bias={"x": 1}), INV, "logit_bias"),
    ("logit_bias-value", body(logit_bias={"1": -100.5}), INV, "logit_bias"),
    ("logit_bias-too-many", body(logit_bias={str(i): 0 for i in range(1025)}), INV, "logit_bias"),
    ("logprobs-blocking", body(logprobs=True), UNS, "logprobs"),
    ("logprobs-false-blocking", body(logprobs=False, stream=False), UNS, "logprobs"),
    ("top_logprobs-blocking", body(top_logprobs=2), UNS, "top_logprobs"),
    ("logprobs-type", body(logprobs="y", stream=True), INV, "logprobs"),
    ("top_logprobs-range", body(stream=True, logprobs=True, top_logprobs=21), INV, "top_logprobs"),
    ("top_logprobs-float", body(stream=True, logprobs=True, top_logprobs=1.0), INV, "top_logprobs"),
    ("top_logprobs-without-logprobs", body(stream=True, top_logprobs=1), INV, "top_logprobs"),
    ("stream-type", body(stream="false"), INV, "stream"),
    # grammar shape (2.3)
    ("grammar-string", body(grammar="x"), INV, "grammar"),
    ("grammar-empty", body(grammar={}), INV, "grammar"),
    ("grammar-two-kinds", body(grammar={"regex": "a", "ebnf": "root ::= 'a'"}), INV, "grammar"),
    ("grammar-only-label", body(grammar={"label": "x"}), INV, "grammar"),
    ("grammar-unknown-key", body(grammar={"regex": "a", "foo": 1}), UNS, "grammar.foo"),
    ("grammar-json_schema-type", body(grammar={"json_schema": "{}"}), INV, "grammar.json_schema"),
    ("grammar-regex-type", body(grammar={"regex": 1}), INV, "grammar.regex"),
    ("grammar-regex-too-long", body(grammar={"regex": "a" * 4097}), INV, "grammar.regex"),
    ("grammar-ebnf-too-long", body(grammar={"ebnf": "a" * 8193}), INV, "grammar.ebnf"),
    ("grammar-label-type", body(grammar={"regex": "a", "label": 1}), INV, "grammar.label"),
    ("grammar-strict-type", body(grammar={"regex": "a", "strict": "yes"}), INV, "grammar.strict"),
    ("grammar-ebnf-strict", body(grammar={"ebnf": "root ::= 'a'", "strict": True}), UNS, "grammar.strict"),
    ("grammar-too-big", body(grammar={"regex": "a", "label": "x" * 70000}), INV, "grammar"),
    *[
        (
            f"grammar-keyword-{kw}",
            body(grammar={"json_schema": {"properties": {"a": {kw: {}}}}}),
            UNS,
            "grammar.json_schema",
        )
        for kw in ("$dynamicRef", "if", "then", "else", "unevaluatedProperties", "dependentSchemas")
    ],
    ("grammar-external-ref", body(grammar={"json_schema": {"$ref": "other.json#/a"}}), UNS, "grammar.json_schema"),
    ("grammar-anchor-ref", body(grammar={"json_schema": {"$ref": "#node"}}), UNS, "grammar.json_schema"),
    ("grammar-unresolved-ref", body(grammar={"json_schema": {"$ref": "#/$defs/missing"}}), INV, "grammar.json_schema"),
    (
        "grammar-cyclic-ref",
        body(grammar={"json_schema": {"$defs": {"a": {"items": {"$ref": "#/$defs/a"}}}, "$ref": "#/$defs/a"}}),
        INV,
        "grammar.json_schema",
    ),
    ("grammar-too-deep", body(grammar={"json_schema": nested(16)}), INV, "grammar.json_schema"),
    ("grammar-too-many-nodes", body(grammar={"json_schema": {"enum": [0] * 16400}}), INV, "grammar.json_schema"),
    (
        "grammar-ref-expansion-too-big",
        body(
            grammar={
                "json_schema": {
                    "$defs": {
                        "a": {"enum": list(range(3000))},
                        "b": {"properties": {str(i): {"$ref": "#/$defs/a"} for i in range(8)}},
                    },
                    "$ref": "#/$defs/b",
                }
            }
        ),
        INV,
        "grammar.json_schema",
    ),
    # options
    ("options-type", body(options=[]), INV, "options"),
    ("options-unknown-key", body(options={"priority": 1}), INV, "options"),
    ("options-profile-other", body(options={"profile": "fast"}), INV, "options.profile"),
    ("options-profile-type", body(options={"profile": 1}), INV, "options.profile"),
    ("options-default_sampling-type", body(options={"default_sampling": 1}), INV, "options.default_sampling"),
    (
        "options-default_sampling-unknown",
        body(options={"default_sampling": {"typical_p": 1}}),
        INV,
        "options.default_sampling.typical_p",
    ),
    (
        "options-default_sampling-temperature",
        body(options={"default_sampling": {"temperature": -1}}),
        INV,
        "options.default_sampling.temperature",
    ),
    (
        "options-default_sampling-top_k",
        body(options={"default_sampling": {"top_k": 0}}),
        INV,
        "options.default_sampling.top_k",
    ),
    (
        "options-default_sampling-seed",
        body(options={"default_sampling": {"seed": 2**64}}),
        INV,
        "options.default_sampling.seed",
    ),
    (
        "options-min_new_tokens-over-max",
        body(max_new_tokens=4, options={"default_sampling": {"min_new_tokens": 5}}),
        INV,
        "options.default_sampling.min_new_tokens",
    ),
    ("options-stop_tokens-type", body(options={"stop_tokens": "x"}), INV, "options.stop_tokens"),
    ("options-stop_tokens-entry", body(options={"stop_tokens": [1.5]}), INV, "options.stop_tokens"),
    *[
        (f"options-{name}-{label}", body(options={name: value}), INV, f"options.{name}")
        for name in ("first_chunk_timeout_s", "inter_chunk_timeout_s", "overall_timeout_s")
        for label, value in (("zero", 0), ("negative", -1), ("string", "5"), ("huge", 2.0**64))
    ],
    # hints
    ("lora_adapter-empty", body(lora_adapter=""), INV, "lora_adapter"),
    ("lora_adapter-type", body(lora_adapter=[]), INV, "lora_adapter"),
    ("routing_key-type", body(routing_key=1), INV, "routing_key"),
    ("prompt_cache_key-type", body(prompt_cache_key={}), INV, "prompt_cache_key"),
    ("safety_identifier-type", body(safety_identifier=1), INV, "safety_identifier"),
]


@pytest.mark.parametrize(
    ("payload", "expected", "param"),
    [pytest.param(p, e, q, id=i) for i, p, e, q in ERROR_ROWS],
)
def test_rejects(payload: Any, expected: tuple[type, str], param: str | None) -> None:
    cls, code = expected
    with pytest.raises(GatewayError) as info:
        parse_generate_request(payload, MODEL)
    err = info.value
    assert type(err) is cls
    assert (err.status, err.code, err.param) == (400, code, param)
    assert "Input should" not in err.message


def test_dedicated_messages() -> None:
    with pytest.raises(UnsupportedField) as info:
        parse_generate_request(body(logprobs=True), MODEL)
    assert info.value.message == ("'logprobs' is supported only with 'stream: true' on the native endpoint")
    with pytest.raises(InvalidRequest) as profile:
        parse_generate_request(body(options={"profile": "fast"}), MODEL)
    assert "'model:profile'" in profile.value.message


@pytest.mark.parametrize(("literal", "param"), [(b'"max_new_tokens": 1180591620717411303424', "max_new_tokens"),
                                              (b'"seed": -18446744073709551617', "seed")])
def test_an_integer_beyond_64_bits_is_out_of_range_not_a_non_integer(literal: bytes, param: str) -> None:
    """orjson, the gateway's JSON reader, reads such a literal as a float; the client still sent an integer."""
    import orjson

    payload = orjson.loads(b'{"prompt": "x", "max_new_tokens": 4, ' + literal + b"}")
    with pytest.raises(InvalidRequest) as info:
        parse_generate_request(payload, MODEL)
    assert info.value.param == param
    assert info.value.message == f"'{param}' is out of range (an integer must fit in 64 bits)"
    with pytest.raises(InvalidRequest, match="must be an integer"):
        parse_generate_request(body(max_new_tokens=1.5), MODEL)


def test_image_over_16_mib_rejected() -> None:
    data = base64.b64encode(b"\0" * (16 * 1024 * 1024 + 1)).decode()
    with pytest.raises(InvalidRequest) as info:
        parse_generate_request(body(images=[{"data": data}]), MODEL)
    assert info.value.param == "images[0].data"


def parse(**changes: Any) -> GenerationRequest:
    return parse_generate_request(body(**changes), MODEL)


def test_minimal_request() -> None:
    req = parse()
    assert (req.model, req.prompt, req.messages) == (MODEL, "Once upon a time", None)
    assert (req.max_tokens, req.max_tokens_param) == (16, "max_new_tokens")
    assert (req.stream, req.logprobs, req.options, req.grammar, req.images) == (False, False, None, None, ())


def test_model_is_copied_verbatim() -> None:
    assert parse_generate_request(body(), "Qwen__Qwen3.5-4B:fast").model == "Qwen__Qwen3.5-4B:fast"


def test_null_means_absent() -> None:
    optional = [
        "images",
        "temperature",
        "top_p",
        "stop",
        "frequency_penalty",
        "presence_penalty",
        "seed",
        "logit_bias",
        "logprobs",
        "top_logprobs",
        "grammar",
        "stream",
        "options",
        "lora_adapter",
        "routing_key",
        "prompt_cache_key",
        "safety_identifier",
    ]
    assert parse(**{k: None for k in optional}) == parse()
    assert parse(grammar={"regex": "a+", "json_schema": None, "label": None}).grammar == (
        GrammarSpec(kind="regex", value="a+")
    )


def test_images_decode_and_format_lowercases() -> None:
    jpeg = base64.b64encode(b"\xff\xd8\xff\xdb").decode()
    req = parse(images=[{"data": PNG_B64, "format": "PNG"}, {"data": jpeg}])
    assert req.images == (ImageInput(PNG, "png"), ImageInput(b"\xff\xd8\xff\xdb", "jpeg"))
    assert req.image_param == "images"
    assert len(parse(images=[{"data": PNG_B64}] * 16).images) == 16


@pytest.mark.parametrize(
    ("grammar", "spec"),
    [
        ({"regex": "[0-9]+", "label": "digits"}, GrammarSpec(kind="regex", value="[0-9]+", label="digits")),
        ({"ebnf": "root ::= 'a'", "strict": False}, GrammarSpec(kind="ebnf", value="root ::= 'a'")),
        (
            {"json_schema": {"type": "object"}, "strict": True},
            GrammarSpec(kind="json_schema", value={"type": "object"}, strict=True),
        ),
        (
            {
                "json_schema": {
                    "definitions": {"s": {"type": "string"}},
                    "properties": {"if": {"$ref": "#/definitions/s"}, "b": {"$ref": "#/definitions/s", "maxLength": 3}},
                }
            },
            GrammarSpec(
                kind="json_schema",
                value={"properties": {"if": {"type": "string"}, "b": {"maxLength": 3, "allOf": [{"type": "string"}]}}},
            ),
        ),
    ],
)
def test_grammar_mapping(grammar: dict[str, Any], spec: GrammarSpec) -> None:
    assert parse(grammar=grammar).grammar == spec


def test_schema_at_depth_limit_is_accepted() -> None:
    # nested(15) is 16 nested objects: exactly the limit.
    assert parse(grammar={"json_schema": nested(15)}).grammar is not None


def test_options_and_typed_override() -> None:
    options = {
        "profile": "default",
        "default_sampling": {
            "temperature": 0.2,
            "top_p": 0.9,
            "top_k": 20,
            "min_new_tokens": 2,
            "seed": 7,
            "frequency_penalty": 0.5,
            "presence_penalty": 0.1,
        },
        "stop_tokens": [2, "</s>"],
        "overall_timeout_s": 30,
    }
    req = parse(options=options, temperature=1.0, seed=9)
    assert (req.temperature, req.seed) == (1.0, 9)  # typed fields win
    assert (req.top_p, req.top_k, req.min_tokens) == (0.9, 20, 2)
    assert (req.frequency_penalty, req.presence_penalty) == (0.5, 0.1)
    assert req.options is not None and "profile" not in req.options
    assert req.options["stop_tokens"] == [2, "</s>"]
    assert req.options["overall_timeout_s"] == 30
    assert parse(options={"profile": "default"}).options is None


def test_fields_are_carried_and_safety_identifier_dropped() -> None:
    req = parse(
        stream=True,
        logprobs=True,
        top_logprobs=3,
        stop=["\n\n"],
        seed=-(2**63),
        logit_bias={"5": 100},
        frequency_penalty=2,
        presence_penalty=-2,
        top_p=1,
        temperature=0,
        lora_adapter="a1",
        routing_key="rk",
        prompt_cache_key="pk",
        safety_identifier="person-1",
    )
    assert (req.stream, req.logprobs, req.top_logprobs, req.stop) == (True, True, 3, ("\n\n",))
    assert (req.seed, req.logit_bias) == (-(2**63), {5: 100.0})
    assert (req.lora_adapter, req.routing_key, req.prompt_cache_key) == ("a1", "rk", "pk")
    assert "person-1" not in repr(req)
    assert parse(logit_bias={}).logit_bias is None
    assert parse(stop=[]).stop == ()


def test_openapi_schemas() -> None:
    schemas = build_openapi()["components"]["schemas"]
    assert {"ChatCompletionRequest", "GenerateRequest"} <= set(schemas)
    gen = schemas["GenerateRequest"]
    assert set(gen["required"]) == {"prompt", "max_new_tokens"}
    assert gen["additionalProperties"] is False
    assert "messages" in schemas["ChatCompletionRequest"]["properties"]


# ---- property: any JSON value in any field never escapes as another exception ----------------

FIELDS = [
    "prompt",
    "max_new_tokens",
    "images",
    "temperature",
    "top_p",
    "stop",
    "frequency_penalty",
    "presence_penalty",
    "seed",
    "logit_bias",
    "logprobs",
    "top_logprobs",
    "grammar",
    "stream",
    "options",
    "lora_adapter",
    "routing_key",
    "prompt_cache_key",
    "safety_identifier",
]
ODD_VALUES: list[Any] = [
    None,
    True,
    False,
    0,
    1,
    -1,
    1.5,
    2**64,
    float("inf"),
    "",
    "x",
    "default",
    [],
    [None],
    [""],
    [{}],
    [{"data": ""}],
    [{"data": PNG_B64, "format": None}],
    {},
    {"a": 1},
    {"regex": None},
    {"json_schema": {"$ref": "#"}},
    {"profile": None},
    {"default_sampling": {"min_new_tokens": 99}},
    {"1": 1},
    {"json_schema": {"$ref": 5}},
]


def parse_on_model(payload: dict[str, Any]) -> GenerationRequest:
    return parse_generate_request(payload, MODEL)


@pytest.mark.parametrize("field", FIELDS)
def test_odd_values_in_every_field(field: str) -> None:
    for value in ODD_VALUES:
        check_any_value(parse_on_model, body, field, value)


@settings(max_examples=400, deadline=None)
@given(field=st.sampled_from(FIELDS), value=JSON_VALUES)
def test_any_json_value_in_any_field(field: str, value: Any) -> None:
    check_any_value(parse_on_model, body, field, value)
