"""`POST /v1/chat/completions` request contract (docs/contract.md, "Chat completions")."""

from __future__ import annotations

from typing import Annotated, Any, ClassVar

from pydantic import AfterValidator, Field, WithJsonSchema, model_validator

from gateway.contracts.chat_messages import ChatMessage
from gateway.contracts.common import (
    LOGIT_BIAS_SCHEMA,
    STOP_SCHEMA,
    U32_MAX,
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
    logit_bias_map,
    stop_sequences,
    validate_body,
    violation,
)
from gateway.contracts.images import MAX_IMAGES
from gateway.contracts.tools import MAX_TOOLS, TOOL_CHOICE_SCHEMA, ResponseFormat, Tool, checked_tool_choice
from gateway.domain import GenerationRequest
from gateway.errors import quoted

DEFAULT_MAX_TOKENS = 1024

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


class StreamOptions(ContractModel):
    include_usage: bool | None = None


class GuardianConfig(ContractModel):
    risk_name: Annotated[str, Field(min_length=1, max_length=128)]


class ChatTemplateKwargs(ContractModel):
    enable_thinking: bool | None = None
    guardian_config: GuardianConfig | None = None


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
    tool_choice: Annotated[Any, AfterValidator(checked_tool_choice), WithJsonSchema(TOOL_CHOICE_SCHEMA)] = None
    parallel_tool_calls: bool | None = None
    response_format: ResponseFormat | None = None
    chat_template_kwargs: ChatTemplateKwargs | None = None
    include_reasoning: bool | None = None
    user: str | None = None  # never logged or sent on; with auth off, its keyed hash is the fair-share tenant
    safety_identifier: str | None = None  # accepted and dropped (PII)
    prompt_cache_key: str | None = None
    routing_key: str | None = None
    lora_adapter: NonEmptyStr | None = None
    priority: Priority | None = None

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
        """The wire-neutral request (`safety_identifier` is dropped here; `user` only names a fair-share tenant)."""
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
            priority=self.priority or 0,
            user=self.user,
        )


def parse_chat_request(body: Any, *, default_max_tokens: int = DEFAULT_MAX_TOKENS) -> GenerationRequest:
    """Validate a decoded chat body; raises `InvalidRequest` / `UnsupportedField` on violations."""
    request = validate_body(ChatCompletionRequest, body)
    return request.to_generation_request(default_max_tokens)
