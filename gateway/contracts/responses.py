"""`POST /v1/responses` request contract (OpenAI Responses API), strict allow-list like chat.

What needs a store (`previous_response_id`, `store: true`) is validated here and resolved by the
resource against the configured store (gateway/responses_store.py); `background` is refused.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Annotated, Any, ClassVar, Literal

from pydantic import AfterValidator, Field, WithJsonSchema, model_validator

from gateway.contracts.chat import MaxTokens
from gateway.contracts.common import (
    UNSUPPORTED,
    ContractModel,
    NonEmptyStr,
    Priority,
    Seed,
    TopK,
    TopLogprobs,
    TopP,
    validate_body,
    violation,
)
from gateway.contracts.responses_input import INPUT_SCHEMA, ParsedInput, parse_input
from gateway.contracts.responses_tools import TOOL_CHOICE_SCHEMA, FunctionTool, TextFormat, checked_tool_choice
from gateway.contracts.tools import MAX_TOOLS
from gateway.domain import GenerationRequest
from gateway.errors import InvalidRequest, UnsupportedField
from gateway.profile import ModelProfile

LOGPROBS_INCLUDE = "message.output_text.logprobs"
# asked for by Codex-style clients that run without a store; we return reasoning in clear instead
ENCRYPTED_REASONING_INCLUDE = "reasoning.encrypted_content"
MAX_METADATA_KEYS = 16

_OUT_OF_SCOPE = "is out of scope for this endpoint"
REJECTED_KEYS: dict[str, str] = {
    key: _OUT_OF_SCOPE for key in ("conversation", "prompt", "service_tier", "max_tool_calls", "context_management")
}


class TextConfig(ContractModel):
    format: TextFormat | None = None


class ReasoningConfig(ContractModel):
    effort: Literal["none", "minimal", "low", "medium", "high", "xhigh"] | None = None
    summary: Literal["auto", "concise", "detailed"] | None = None


def _metadata(value: Any) -> dict[str, str]:
    if not isinstance(value, dict):
        raise violation("must be an object of string values")
    if len(value) > MAX_METADATA_KEYS:
        raise violation(f"must have at most {MAX_METADATA_KEYS} keys")
    for key, item in value.items():
        if not isinstance(key, str) or len(key) > 64:
            raise violation("keys must be strings of at most 64 characters")
        if not isinstance(item, str) or len(item) > 512:
            raise violation("values must be strings of at most 512 characters", key)
    return value


_METADATA_SCHEMA: dict[str, Any] = {"type": "object", "maxProperties": MAX_METADATA_KEYS,
                                    "additionalProperties": {"type": "string", "maxLength": 512}}


class ResponsesRequest(ContractModel):
    """OpenAI Responses request; strict allow-list (unknown keys: 400 unsupported_field)."""

    rejected_keys: ClassVar[dict[str, str]] = REJECTED_KEYS

    model: NonEmptyStr
    # validated into messages once, here, so errors carry `input[...]` (images are decoded once)
    input: Annotated[Any, AfterValidator(parse_input), WithJsonSchema(INPUT_SCHEMA)]
    instructions: str | None = None
    max_output_tokens: MaxTokens | None = None
    temperature: Annotated[float, Field(ge=0, le=2)] | None = None
    top_p: TopP | None = None
    top_logprobs: TopLogprobs | None = None
    include: list[str] | None = None
    tools: Annotated[list[FunctionTool], Field(max_length=MAX_TOOLS)] | None = None
    tool_choice: Annotated[Any, AfterValidator(checked_tool_choice), WithJsonSchema(TOOL_CHOICE_SCHEMA)] = None
    parallel_tool_calls: bool | None = None
    text: TextConfig | None = None
    reasoning: ReasoningConfig | None = None
    metadata: Annotated[Any, AfterValidator(_metadata), WithJsonSchema(_METADATA_SCHEMA)] = None
    user: str | None = None  # echoed, never logged
    safety_identifier: str | None = None  # echoed, never logged
    prompt_cache_key: str | None = None
    store: bool | None = None
    previous_response_id: NonEmptyStr | None = None
    background: bool | None = None
    stream: bool | None = None
    truncation: Literal["disabled", "auto"] | None = None
    # SIE extensions, as on chat
    top_k: TopK | None = None
    seed: Seed | None = None
    lora_adapter: NonEmptyStr | None = None
    routing_key: str | None = None
    priority: Priority | None = None

    @model_validator(mode="after")
    def _cross_field(self) -> ResponsesRequest:
        for i, entry in enumerate(self.include or ()):
            if entry not in (LOGPROBS_INCLUDE, ENCRYPTED_REASONING_INCLUDE):
                raise violation(f"'{entry}' is not supported; only '{LOGPROBS_INCLUDE}'", "include", i,
                                code=UNSUPPORTED)
        if self.top_logprobs and not self.wants_logprobs:
            raise violation(f"requires 'include' to contain '{LOGPROBS_INCLUDE}'", "top_logprobs")
        if self.background:
            raise violation("is not supported: responses run in the foreground only", "background",
                            code=UNSUPPORTED)
        if self.truncation == "auto":
            raise violation("'auto' is not supported; the input is never truncated", "truncation", code=UNSUPPORTED)
        self._check_tool_choice()
        return self

    def _check_tool_choice(self) -> None:
        choice = self.tool_choice
        if choice is None:
            return
        if isinstance(choice, dict) and choice["name"] not in {t.name for t in self.tools or ()}:
            raise violation(f"names function '{choice['name']}' which is not in 'tools'", "tool_choice")
        if choice == "required" and not self.tools:
            raise violation("requires 'tools'", "tool_choice")
        fmt = self.text.format if self.text else None
        if self.forces_tool_call and fmt is not None and fmt.type != "text":
            raise violation("cannot force a tool call together with a non-text 'text.format'", "tool_choice")

    @property
    def forces_tool_call(self) -> bool:
        """`tool_choice` "required" or a named function (GenerationRequest.forces_tool_call says what follows)."""
        return bool(self.tools) and (self.tool_choice == "required" or isinstance(self.tool_choice, dict))

    @property
    def wants_logprobs(self) -> bool:
        return LOGPROBS_INCLUDE in (self.include or ())

    @property
    def parsed_input(self) -> ParsedInput:
        parsed: ParsedInput = self.input  # the AfterValidator's result
        return parsed

    def chat_tool_choice(self) -> Any:
        if isinstance(self.tool_choice, dict):
            return {"type": "function", "function": {"name": self.tool_choice["name"]}}
        return self.tool_choice


@dataclass(frozen=True)
class ResponsesJob:
    """A validated Responses request: what to run once the conversation history (if any) is known."""

    request: ResponsesRequest
    default_max_tokens: int

    def generation_request(self, history: tuple[dict[str, Any], ...] = ()) -> GenerationRequest:
        """The engine request: instructions, then the replayed conversation, then this input."""
        r = self.request
        messages: list[dict[str, Any]] = []
        if r.instructions:
            messages.append({"role": "system", "content": r.instructions})
        messages.extend(history)
        self._check_outputs_answer_calls(history)
        messages.extend(r.parsed_input.messages)
        fmt = r.text.format if r.text else None
        template_kwargs = None
        if r.reasoning is not None and r.reasoning.effort is not None:
            template_kwargs = {"enable_thinking": r.reasoning.effort not in ("none", "minimal")}
        return GenerationRequest(
            model=r.model,
            max_tokens=r.max_output_tokens if r.max_output_tokens is not None else self.default_max_tokens,
            max_tokens_param="max_output_tokens",
            max_tokens_defaulted=r.max_output_tokens is None,
            messages=tuple(messages),
            messages_param="input",
            stream=bool(r.stream),
            temperature=r.temperature,
            top_p=r.top_p,
            top_k=r.top_k,
            seed=r.seed,
            logprobs=r.wants_logprobs,
            top_logprobs=(r.top_logprobs or 0) if r.wants_logprobs else 0,
            lora_adapter=r.lora_adapter,
            grammar=fmt.grammar() if fmt else None,
            tools=tuple(t.chat_shape() for t in r.tools) if r.tools else None,
            tool_choice=r.chat_tool_choice(),
            parallel_tool_calls=r.parallel_tool_calls,
            chat_template_kwargs=template_kwargs,
            include_reasoning=True,  # reasoning models answer with a reasoning item; others send none
            images=tuple(r.parsed_input.images),
            image_param=r.parsed_input.image_param,
            image_data_params=tuple(r.parsed_input.image_data_params),
            routing_key=r.routing_key,
            prompt_cache_key=r.prompt_cache_key,
            priority=r.priority or 0,
            user=r.user,
        )


    def _check_outputs_answer_calls(self, history: tuple[dict[str, Any], ...]) -> None:
        """A `function_call_output` must answer a call of this input or of the replayed conversation."""
        parsed = self.request.parsed_input
        known = set(parsed.call_ids)
        known.update(call["id"] for m in history for call in m.get("tool_calls") or ())
        for call_id, i in parsed.outputs.items():
            if call_id not in known:
                raise InvalidRequest(f"no function_call with call_id '{call_id}' in the input or the previous "
                                     "response", param=f"input[{i}].call_id")


def check_reasoning_effort(request: ResponsesRequest, profile: ModelProfile) -> None:
    """`reasoning.effort` steers reasoning models only; elsewhere it would be silently meaningless."""
    if request.reasoning is not None and request.reasoning.effort is not None and not profile.reasoning:
        raise UnsupportedField(f"model '{profile.name}' is not a reasoning model", param="reasoning.effort")


def parse_responses_request(body: Any, *, default_max_tokens: int) -> ResponsesJob:
    """Validate a decoded Responses body; raises `InvalidRequest` / `UnsupportedField` on violations."""
    return ResponsesJob(validate_body(ResponsesRequest, body), default_max_tokens)
