"""`POST /v1/chat/completions` request contract (docs/contract.md, "Chat completions")."""

from __future__ import annotations

from typing import Annotated, Any, ClassVar, Literal

from pydantic import AfterValidator, Field, WithJsonSchema, field_validator, model_validator

from gateway.contracts.chat_messages import ChatMessage
from gateway.contracts.common import (
    INVALID,
    LOGIT_BIAS_SCHEMA,
    STOP_SCHEMA,
    U32_MAX,
    UNSUPPORTED,
    ContractModel,
    NonEmptyStr,
    Penalty,
    Seed,
    Temperature,
    TopK,
    TopLogprobs,
    TopP,
    logit_bias_map,
    stop_sequences,
    validate_body,
    violation,
)
from gateway.contracts.images import MAX_IMAGES
from gateway.contracts.schema_limits import SchemaRejected, check_and_inline
from gateway.domain import GenerationRequest, GrammarSpec
from gateway.errors import quoted

DEFAULT_MAX_TOKENS = 1024
MAX_TOOLS = 64

_OUT_OF_SCOPE = "is out of scope for this endpoint"
_DEPRECATED = "is deprecated by OpenAI; use 'tools' / 'tool_choice'"
REJECTED_KEYS: dict[str, str] = {
    "functions": _DEPRECATED,
    "function_call": _DEPRECATED,
    **{
        key: _OUT_OF_SCOPE
        for key in (
            "modalities",
            "audio",
            "metadata",
            "store",
            "service_tier",
            "prediction",
            "reasoning_effort",
            "verbosity",
        )
    },
}

MaxTokens = Annotated[int, Field(ge=1, le=U32_MAX)]
Candidates = Annotated[int, Field(ge=1, le=128)]


def _schema(value: dict[str, Any]) -> dict[str, Any]:
    """Run the JSON-Schema walker inside a field validator (param = that field)."""
    try:
        return check_and_inline(value)
    except SchemaRejected as exc:
        raise violation(exc.rule, code=exc.code) from None


class ToolFunction(ContractModel):
    # any deviation in a tool definition is invalid_request (docs/contract.md, "Chat completions", `tools`)
    unknown_key_code = INVALID

    name: NonEmptyStr
    description: str | None = None
    parameters: Annotated[dict[str, Any], AfterValidator(_schema)] | None = None
    # Not in the SIE seed, but OpenAI SDK helpers send it; accepted so those clients work.
    strict: bool | None = None


class Tool(ContractModel):
    unknown_key_code = INVALID

    type: Literal["function"]
    function: ToolFunction

    def as_dict(self) -> dict[str, Any]:
        return {"type": "function", "function": self.function.model_dump(exclude_none=True)}


class StreamOptions(ContractModel):
    include_usage: bool | None = None


class JsonSchemaFormat(ContractModel):
    name: str | None = None
    description: str | None = None
    schema_: Annotated[dict[str, Any], AfterValidator(_schema)] = Field(alias="schema")
    strict: bool | None = None


class ResponseFormat(ContractModel):
    type: str
    json_schema: JsonSchemaFormat | None = None

    @field_validator("type")
    @classmethod
    def _known_type(cls, value: str) -> str:
        if value not in ("text", "json_object", "json_schema"):
            raise violation("must be 'text', 'json_object' or 'json_schema'", code=UNSUPPORTED)
        return value

    @model_validator(mode="after")
    def _schema_present(self) -> ResponseFormat:
        if self.type == "json_schema" and self.json_schema is None:
            raise violation("is required when type is 'json_schema'", "json_schema")
        return self

    def grammar(self) -> GrammarSpec | None:
        if self.type == "json_object":
            return GrammarSpec(kind="json_object", value={"type": "object"}, label="json_object",
                               param="response_format")
        if self.type == "json_schema" and self.json_schema is not None:
            spec = self.json_schema
            return GrammarSpec(kind="json_schema", value=spec.schema_, label=spec.name, strict=bool(spec.strict),
                               param="response_format")
        return None


class GuardianConfig(ContractModel):
    risk_name: Annotated[str, Field(min_length=1, max_length=128)]


class ChatTemplateKwargs(ContractModel):
    enable_thinking: bool | None = None
    guardian_config: GuardianConfig | None = None


def _tool_choice(value: Any) -> Any:
    if isinstance(value, str) and value in ("auto", "none", "required"):
        return value
    if isinstance(value, dict) and set(value) == {"type", "function"} and value["type"] == "function":
        fn = value["function"]
        if isinstance(fn, dict) and set(fn) == {"name"} and isinstance(fn["name"], str) and fn["name"]:
            return {"type": "function", "function": {"name": fn["name"]}}
    raise violation(
        "must be 'auto', 'none', 'required' or an object naming a function (type 'function', function.name)"
    )


_TOOL_CHOICE_SCHEMA: dict[str, Any] = {
    "anyOf": [
        {"enum": ["auto", "none", "required"]},
        {
            "type": "object",
            "properties": {
                "type": {"const": "function"},
                "function": {
                    "type": "object",
                    "properties": {"name": {"type": "string", "minLength": 1}},
                    "required": ["name"],
                },
            },
            "required": ["type", "function"],
        },
    ]
}


class ChatCompletionRequest(ContractModel):
    """OpenAI-compatible chat request with SIE extensions; strict allow-list."""

    rejected_keys: ClassVar[dict[str, str]] = REJECTED_KEYS

    model: NonEmptyStr
    messages: Annotated[list[ChatMessage], Field(min_length=1)]
    max_completion_tokens: MaxTokens | None = None
    max_tokens: MaxTokens | None = None
    temperature: Temperature | None = None
    top_p: TopP | None = None
    top_k: TopK | None = None
    repetition_penalty: Annotated[float, Field(gt=0, le=2)] | None = None
    min_tokens: Annotated[int, Field(ge=0, le=U32_MAX)] | None = None
    frequency_penalty: Penalty | None = None
    presence_penalty: Penalty | None = None
    stop: Annotated[
        Any,
        AfterValidator(lambda v: stop_sequences(v, allow_string=True)),
        WithJsonSchema(STOP_SCHEMA),
    ] = None
    n: Candidates | None = None
    best_of: Candidates | None = None
    seed: Seed | None = None
    logprobs: bool | None = None
    top_logprobs: TopLogprobs | None = None
    logit_bias: Annotated[Any, AfterValidator(logit_bias_map), WithJsonSchema(LOGIT_BIAS_SCHEMA)] = None
    stream: bool | None = None
    stream_options: StreamOptions | None = None
    tools: Annotated[list[Tool], Field(min_length=1, max_length=MAX_TOOLS)] | None = None
    tool_choice: Annotated[Any, AfterValidator(_tool_choice), WithJsonSchema(_TOOL_CHOICE_SCHEMA)] = None
    parallel_tool_calls: bool | None = None
    response_format: ResponseFormat | None = None
    chat_template_kwargs: ChatTemplateKwargs | None = None
    include_reasoning: bool | None = None
    user: str | None = None  # accepted and dropped (PII)
    safety_identifier: str | None = None  # accepted and dropped (PII)
    prompt_cache_key: str | None = None
    routing_key: str | None = None
    lora_adapter: NonEmptyStr | None = None

    @model_validator(mode="after")
    def _cross_field(self) -> ChatCompletionRequest:
        self._check_image_count()
        self._check_candidates()
        if self.top_logprobs and not self.logprobs:
            raise violation("requires 'logprobs: true'", "top_logprobs")
        self._check_tool_choice()
        return self

    def _check_image_count(self) -> None:
        seen = 0
        for i, message in enumerate(self.messages):
            for j, _image in message.images:
                seen += 1
                if seen > MAX_IMAGES:
                    raise violation(
                        f"exceeds the limit of {MAX_IMAGES} images per request",
                        "messages",
                        i,
                        "content",
                        j,
                    )

    def _check_candidates(self) -> None:
        if self.best_of is None:
            return
        if self.best_of < (self.n or 1):
            raise violation("must be >= n", "best_of")
        if self.stream:
            raise violation("is not supported with 'stream: true'", "best_of", code=UNSUPPORTED)

    def _check_tool_choice(self) -> None:
        choice = self.tool_choice
        if choice is None:
            return
        if self.tools is None:
            raise violation("requires 'tools'", "tool_choice")
        if isinstance(choice, dict):
            name = choice["function"]["name"]
            if name not in {tool.function.name for tool in self.tools}:
                raise violation(f"names function {quoted(name)} which is not in 'tools'", "tool_choice")
        forcing = choice == "required" or isinstance(choice, dict)
        if forcing and self.response_format is not None and self.response_format.type != "text":
            raise violation(
                "cannot force a tool call together with a non-text 'response_format'",
                "tool_choice",
            )

    def to_generation_request(self, default_max_tokens: int) -> GenerationRequest:
        """The wire-neutral request (`user` and `safety_identifier` are dropped here)."""
        defaulted = False
        if self.max_completion_tokens is not None:
            max_tokens, max_param = self.max_completion_tokens, "max_completion_tokens"
        elif self.max_tokens is not None:
            max_tokens, max_param = self.max_tokens, "max_tokens"
        else:
            max_tokens, max_param = default_max_tokens, "max_completion_tokens"
            defaulted = True
        images = [(i, j, img) for i, m in enumerate(self.messages) for j, img in m.images]
        image_param = f"messages[{images[0][0]}].content[{images[0][1]}].type" if images else None
        stream = bool(self.stream)
        usage = bool(self.stream_options and self.stream_options.include_usage)
        return GenerationRequest(
            model=self.model,
            max_tokens=max_tokens,
            max_tokens_param=max_param,
            max_tokens_defaulted=defaulted,
            messages=tuple(m.as_dict() for m in self.messages),
            stream=stream,
            # stream_options is legal but ignored on blocking requests.
            include_usage=stream and usage,
            temperature=self.temperature,
            top_p=self.top_p,
            top_k=self.top_k,
            min_tokens=self.min_tokens,
            repetition_penalty=self.repetition_penalty,
            presence_penalty=self.presence_penalty,
            frequency_penalty=self.frequency_penalty,
            logit_bias=self.logit_bias,
            seed=self.seed,
            stop=self.stop or (),
            logprobs=bool(self.logprobs),
            top_logprobs=self.top_logprobs or 0,
            n=self.n or 1,
            best_of=self.best_of,
            lora_adapter=self.lora_adapter,
            grammar=self.response_format.grammar() if self.response_format else None,
            tools=tuple(t.as_dict() for t in self.tools) if self.tools else None,
            tool_choice=self.tool_choice,
            parallel_tool_calls=self.parallel_tool_calls,
            chat_template_kwargs=(
                self.chat_template_kwargs.model_dump(exclude_none=True) or None if self.chat_template_kwargs else None
            ),
            include_reasoning=bool(self.include_reasoning),
            images=tuple(img for _, _, img in images),
            image_param=image_param,
            image_data_params=tuple(f"messages[{i}].content[{j}].image_url" for i, j, _ in images),
            routing_key=self.routing_key,
            prompt_cache_key=self.prompt_cache_key,
        )


def parse_chat_request(body: Any, *, default_max_tokens: int = DEFAULT_MAX_TOKENS) -> GenerationRequest:
    """Validate a decoded chat body; raises `InvalidRequest` / `UnsupportedField` on violations."""
    request = validate_body(ChatCompletionRequest, body)
    return request.to_generation_request(default_max_tokens)
