"""`POST /v1/generate/{model}` request contract (docs/contract.md, "Native generate")."""

from __future__ import annotations

from typing import Annotated, Any, ClassVar

from pydantic import (
    AfterValidator,
    Field,
    PrivateAttr,
    WithJsonSchema,
    field_validator,
    model_validator,
)

from gateway.contracts.common import (
    INVALID,
    LOGIT_BIAS_SCHEMA,
    UNSUPPORTED,
    ContractModel,
    NonEmptyStr,
    Penalty,
    Priority,
    Seed,
    Temperature,
    TopK,
    TopLogprobs,
    TopP,
    is_number,
    logit_bias_map,
    stop_sequences,
    validate_body,
    violation,
)
from gateway.contracts.images import (
    MAX_IMAGES,
    ImageRejected,
    decode_canonical_base64,
    normalize_format,
    sniff_format,
)
from gateway.contracts.schema_limits import (
    MAX_SCHEMA_BYTES,
    SchemaRejected,
    check_and_inline,
    serialized_size,
)
from gateway.domain import GenerationRequest, GrammarSpec, ImageInput

MAX_REGEX_CHARS = 4096
MAX_EBNF_CHARS = 8192
GRAMMAR_KINDS = ("json_schema", "regex", "ebnf")


def _image_format(value: str) -> str:
    try:
        return normalize_format(value)
    except ImageRejected as exc:
        raise violation(exc.rule) from None


class NativeImage(ContractModel):
    data: str  # canonical standard base64
    format: Annotated[str, AfterValidator(_image_format)] | None = None

    _raw: bytes = PrivateAttr(default=b"")

    @model_validator(mode="after")
    def _decode(self) -> NativeImage:
        try:
            self._raw = decode_canonical_base64(self.data)
        except ImageRejected as exc:
            raise violation(exc.rule, "data") from None
        return self

    def to_input(self) -> ImageInput:
        return ImageInput(data=self._raw, format=self.format or sniff_format(self._raw))


class NativeGrammar(ContractModel):
    """Exactly one of `json_schema` / `regex` / `ebnf`, plus `label` and `strict`."""

    json_schema: dict[str, Any] | None = None
    regex: Annotated[str, Field(max_length=MAX_REGEX_CHARS)] | None = None
    ebnf: Annotated[str, Field(max_length=MAX_EBNF_CHARS)] | None = None
    label: str | None = None
    strict: bool | None = None

    @classmethod
    def check_raw(cls, data: dict[str, Any]) -> None:
        # Size first: the walker's cost should never depend on an oversized document.
        if serialized_size(data) > MAX_SCHEMA_BYTES:
            raise violation(f"must serialize to at most {MAX_SCHEMA_BYTES} bytes")

    @field_validator("json_schema")
    @classmethod
    def _schema_limits(cls, value: dict[str, Any]) -> dict[str, Any]:
        try:
            return check_and_inline(value)
        except SchemaRejected as exc:
            raise violation(exc.rule, code=exc.code) from None

    @model_validator(mode="after")
    def _one_variant(self) -> NativeGrammar:
        present = [kind for kind in GRAMMAR_KINDS if getattr(self, kind) is not None]
        if len(present) != 1:
            raise violation("must set exactly one of 'json_schema', 'regex' or 'ebnf'")
        if present[0] == "ebnf" and self.strict:
            raise violation("is not supported with 'ebnf'", "strict", code=UNSUPPORTED)
        return self

    def to_spec(self) -> GrammarSpec:
        kind = next(kind for kind in GRAMMAR_KINDS if getattr(self, kind) is not None)
        return GrammarSpec(kind=kind, value=getattr(self, kind), label=self.label, strict=bool(self.strict))


class DefaultSampling(ContractModel):
    unknown_key_code: ClassVar[str | None] = INVALID

    temperature: Temperature | None = None
    top_p: TopP | None = None
    frequency_penalty: Penalty | None = None
    presence_penalty: Penalty | None = None
    top_k: TopK | None = None
    min_new_tokens: Annotated[int, Field(ge=0)] | None = None
    seed: Seed | None = None


Timeout = Annotated[float, Field(gt=0, lt=2**64)]


def _stop_tokens(value: Any) -> list[Any]:
    if not isinstance(value, list) or not all(
        (is_number(t) and isinstance(t, int) and t >= 0) or (isinstance(t, str) and t != "") for t in value
    ):
        raise violation("must be an array of token ids or non-empty strings")
    return value


class GenerateOptions(ContractModel):
    """Governed runtime options; an unknown key is invalid_request on `options` itself."""

    unknown_key_code: ClassVar[str | None] = INVALID
    unknown_key_on_self: ClassVar[bool] = True

    profile: str | None = None
    default_sampling: DefaultSampling | None = None
    stop_tokens: Annotated[
        Any,
        AfterValidator(_stop_tokens),
        WithJsonSchema({"type": "array", "items": {"type": ["integer", "string"]}}),
    ] = None
    first_chunk_timeout_s: Timeout | None = None
    inter_chunk_timeout_s: Timeout | None = None
    overall_timeout_s: Timeout | None = None

    @field_validator("profile")
    @classmethod
    def _default_profile_only(cls, value: str) -> str:
        if value != "default":
            raise violation(
                "",
                message="'options.profile' accepts only 'default'; select other profiles "
                "through the 'model:profile' identity in the path",
            )
        return value

    def forwarded(self) -> dict[str, Any] | None:
        """Options as forwarded to the engine: `profile` is consumed by routing, nulls dropped."""
        out = self.model_dump(exclude_none=True, exclude={"profile"})
        return out or None


_GRAMMAR_SCHEMA: dict[str, Any] = {
    "type": "object",
    "properties": {
        "json_schema": {"type": "object"},
        "regex": {"type": "string", "maxLength": MAX_REGEX_CHARS},
        "ebnf": {"type": "string", "maxLength": MAX_EBNF_CHARS},
        "label": {"type": "string"},
        "strict": {"type": "boolean"},
    },
    "additionalProperties": False,
}


class GenerateRequest(ContractModel):
    """SIE-native generation request; strict allow-list.

    Field order is the order of checks (hint fields, prompt, images, grammar, max_new_tokens,
    options, sampler fields, stream, logprobs), so the first error matches the reference server.
    """

    routing_key: str | None = None
    prompt_cache_key: str | None = None
    safety_identifier: str | None = None  # accepted and dropped (PII)
    lora_adapter: NonEmptyStr | None = None
    prompt: NonEmptyStr
    images: Annotated[list[NativeImage], Field(min_length=1, max_length=MAX_IMAGES)] | None = None
    grammar: Annotated[NativeGrammar, WithJsonSchema(_GRAMMAR_SCHEMA)] | None = None
    max_new_tokens: Annotated[int, Field(ge=1)]
    options: GenerateOptions | None = None
    temperature: Temperature | None = None
    top_p: TopP | None = None
    stop: Annotated[
        Any,
        AfterValidator(lambda v: stop_sequences(v, allow_string=False)),
        WithJsonSchema({"type": "array", "items": {"type": "string", "minLength": 1}}),
    ] = None
    frequency_penalty: Penalty | None = None
    presence_penalty: Penalty | None = None
    seed: Seed | None = None
    logit_bias: Annotated[Any, AfterValidator(logit_bias_map), WithJsonSchema(LOGIT_BIAS_SCHEMA)] = None
    stream: bool | None = None
    logprobs: bool | None = None
    top_logprobs: TopLogprobs | None = None
    priority: Priority | None = None  # SIE extension, as on the OpenAI routes

    @model_validator(mode="after")
    def _cross_field(self) -> GenerateRequest:
        if not self.stream:
            for field in ("logprobs", "top_logprobs"):
                if getattr(self, field) is not None:
                    raise violation(
                        "",
                        field,
                        code=UNSUPPORTED,
                        message=f"'{field}' is supported only with 'stream: true' on the native endpoint",
                    )
        if self.top_logprobs and not self.logprobs:
            raise violation("requires 'logprobs: true'", "top_logprobs")
        sampling = self._sampling()
        if sampling.min_new_tokens is not None and sampling.min_new_tokens > self.max_new_tokens:
            raise violation(
                "must not exceed 'max_new_tokens'",
                "options",
                "default_sampling",
                "min_new_tokens",
            )
        return self

    def _sampling(self) -> DefaultSampling:
        if self.options is not None and self.options.default_sampling is not None:
            return self.options.default_sampling
        return DefaultSampling()

    def to_generation_request(self, model: str) -> GenerationRequest:
        """The wire-neutral request; typed top-level fields override `options.default_sampling`."""
        sampling = self._sampling()
        images = tuple(image.to_input() for image in self.images or ())

        def pick(typed: Any, default: Any) -> Any:
            return typed if typed is not None else default

        return GenerationRequest(
            model=model,
            max_tokens=self.max_new_tokens,
            max_tokens_param="max_new_tokens",
            prompt=self.prompt,
            stream=bool(self.stream),
            temperature=pick(self.temperature, sampling.temperature),
            top_p=pick(self.top_p, sampling.top_p),
            top_k=sampling.top_k,
            min_tokens=sampling.min_new_tokens,
            presence_penalty=pick(self.presence_penalty, sampling.presence_penalty),
            frequency_penalty=pick(self.frequency_penalty, sampling.frequency_penalty),
            logit_bias=self.logit_bias,
            seed=pick(self.seed, sampling.seed),
            stop=self.stop or (),
            logprobs=bool(self.logprobs),
            top_logprobs=self.top_logprobs or 0,
            lora_adapter=self.lora_adapter,
            grammar=self.grammar.to_spec() if self.grammar else None,
            images=images,
            image_param="images" if images else None,
            image_data_params=tuple(f"images[{i}].data" for i in range(len(images))),
            routing_key=self.routing_key,
            prompt_cache_key=self.prompt_cache_key,
            options=self.options.forwarded() if self.options else None,
            priority=self.priority or 0,
        )


def parse_generate_request(body: Any, model: str) -> GenerationRequest:
    """Validate a decoded native generate body; `model` is the decoded path id, copied as is."""
    request = validate_body(GenerateRequest, body)
    return request.to_generation_request(model)
