"""`POST /v1/completions` request contract (OpenAI legacy completions, SIE extensions, vLLM's `ignore_eos`).

The prompt is continued as raw text (`text_input`, no chat template), like native generate. An array of
prompts is one engine request per prompt, each with the request's `n`; choice `p * n + j` is candidate `j`
of prompt `p`, as OpenAI numbers them.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Annotated, Any

from pydantic import AfterValidator, Field, WithJsonSchema, model_validator

from gateway.contracts.chat import Candidates, MaxTokens, StreamOptions
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
    TopP,
    is_number,
    logit_bias_map,
    stop_sequences,
    validate_body,
    violation,
)
from gateway.domain import GenerationRequest, Prompt, prompt_fields

DEFAULT_MAX_TOKENS = 16  # OpenAI's default for this endpoint
MAX_LOGPROBS = 5  # the legacy API's ceiling
MAX_CHOICES = 128  # prompts x candidates per request: each candidate holds an engine slot

_TOKEN_IDS_SCHEMA = {"type": "array", "minItems": 1, "items": {"type": "integer", "minimum": 0}}
_PROMPT_SCHEMA: dict[str, Any] = {
    "anyOf": [
        {"type": "string", "minLength": 1},
        {"type": "array", "minItems": 1, "items": {"type": "string", "minLength": 1}},
        _TOKEN_IDS_SCHEMA,
        {"type": "array", "minItems": 1, "items": _TOKEN_IDS_SCHEMA},
    ]
}


def _is_token_id(value: Any) -> bool:
    return isinstance(value, int) and is_number(value)


def _token_ids(value: list[Any], *path: int) -> tuple[int, ...]:
    if not value:
        raise violation("must not be empty", *path)
    for i, token in enumerate(value):
        if not _is_token_id(token) or not 0 <= token < 2**31:
            raise violation("must be a token id (a non-negative integer)", *path, i)
    return tuple(value)


def _prompts(value: Any) -> tuple[Prompt, ...]:
    """`prompt` as a tuple of prompts (one per choice set): a non-empty string, an array of them, token ids
    (`[1, 2]`) or an array of token-id arrays (`[[1, 2], [3]]`). The engine checks ids against its vocabulary."""
    if isinstance(value, str):
        if not value:
            raise violation("must be a non-empty string")
        return (value,)
    if not isinstance(value, list):
        raise violation("must be a string, an array of strings, or token ids")
    if not value:
        raise violation("must not be empty")
    if _is_token_id(value[0]):
        return (_token_ids(value),)
    prompts: list[Prompt] = []
    for i, item in enumerate(value):
        if isinstance(item, list):
            prompts.append(_token_ids(item, i))
        elif isinstance(item, str) and item:
            prompts.append(item)
        else:
            raise violation("must be a non-empty string or an array of token ids", i)
    return tuple(prompts)


class CompletionStreamOptions(StreamOptions):
    """vLLM's `continuous_usage_stats` too (GuideLLM sends it): usage on every chunk, with `include_usage`."""

    continuous_usage_stats: bool | None = None


class CompletionRequest(ContractModel):
    """OpenAI-compatible completions request with SIE extensions; strict allow-list."""

    model: NonEmptyStr
    prompt: Annotated[Any, AfterValidator(_prompts), WithJsonSchema(_PROMPT_SCHEMA)]
    suffix: str | None = None  # only "" (no suffix) is accepted: insertion is not supported
    max_tokens: MaxTokens | None = None
    temperature: Temperature | None = None
    top_p: TopP | None = None
    n: Candidates | None = None
    best_of: Candidates | None = None
    stream: bool | None = None
    stream_options: CompletionStreamOptions | None = None
    logprobs: Annotated[int, Field(ge=0, le=MAX_LOGPROBS)] | None = None
    echo: bool | None = None
    stop: Annotated[
        Any,
        AfterValidator(lambda v: stop_sequences(v, allow_string=True)),
        WithJsonSchema(STOP_SCHEMA),
    ] = None
    presence_penalty: Penalty | None = None
    frequency_penalty: Penalty | None = None
    logit_bias: Annotated[Any, AfterValidator(logit_bias_map), WithJsonSchema(LOGIT_BIAS_SCHEMA)] = None
    seed: Seed | None = None
    user: str | None = None  # never logged or sent on; with auth off, its keyed hash is the fair-share tenant
    # SIE extensions, as on chat
    top_k: TopK | None = None
    min_tokens: Annotated[int, Field(ge=0, le=U32_MAX)] | None = None
    repetition_penalty: Annotated[float, Field(gt=0, le=2)] | None = None
    lora_adapter: NonEmptyStr | None = None
    prompt_cache_key: str | None = None
    routing_key: str | None = None
    priority: Priority | None = None
    # vLLM's extension, on this route only: `vllm bench serve` sends it with its random dataset.
    ignore_eos: bool | None = None

    @model_validator(mode="after")
    def _cross_field(self) -> CompletionRequest:
        if self.suffix:
            raise violation("is not supported (no insertion); leave it out", "suffix", code=UNSUPPORTED)
        if self.echo and self.logprobs is not None:
            # the engine reports logprobs of generated tokens only, not of the echoed prompt
            raise violation("is not supported together with 'logprobs'", "echo", code=UNSUPPORTED)
        if self.echo and any(not isinstance(p, str) for p in self.prompt):
            raise violation("is not supported with a prompt given as token ids (its text is not known here)", "echo",
                            code=UNSUPPORTED)
        self._check_candidates()
        return self

    def _check_candidates(self) -> None:
        n = self.n or 1
        if self.best_of is not None:
            if self.best_of < n:
                raise violation("must be >= n", "best_of")
            if self.stream:
                raise violation("is not supported with 'stream: true'", "best_of", code=UNSUPPORTED)
        width = max(n, self.best_of or 1)
        if len(self.prompt) * width > MAX_CHOICES:
            raise violation(
                f"has {len(self.prompt)} prompts of {width} candidates each; the limit is {MAX_CHOICES} "
                "candidates per request",
                "prompt",
            )

    def to_generation_request(self) -> GenerationRequest:
        """The wire-neutral request for the first prompt (`user` only names a fair-share tenant)."""
        stream = bool(self.stream)
        usage = bool(self.stream_options and self.stream_options.include_usage)
        return GenerationRequest(
            model=self.model,
            max_tokens=self.max_tokens if self.max_tokens is not None else DEFAULT_MAX_TOKENS,
            max_tokens_param="max_tokens",
            max_tokens_defaulted=self.max_tokens is None,
            **prompt_fields(self.prompt[0]),
            stream=stream,
            include_usage=stream and usage,  # stream_options is legal but ignored on blocking requests
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
            logprobs=self.logprobs is not None,
            top_logprobs=self.logprobs or 0,
            n=self.n or 1,
            best_of=self.best_of,
            lora_adapter=self.lora_adapter,
            ignore_eos=bool(self.ignore_eos),
            routing_key=self.routing_key,
            prompt_cache_key=self.prompt_cache_key,
            priority=self.priority or 0,
            user=self.user,
        )


@dataclass(frozen=True)
class CompletionJob:
    """A validated completions request: the engine request (for `prompts[0]`) and how to answer it."""

    request: GenerationRequest
    prompts: tuple[Prompt, ...]
    echo: bool
    logprobs: int | None  # the legacy integer; None: no logprobs object
    continuous_usage: bool = False  # usage on every streamed chunk (vLLM's continuous_usage_stats)


def parse_completion_request(body: Any) -> CompletionJob:
    """Validate a decoded completions body; raises `InvalidRequest` / `UnsupportedField` on violations."""
    request = validate_body(CompletionRequest, body)
    greq = request.to_generation_request()
    # as vLLM: continuous usage needs include_usage (and a stream)
    continuous = greq.include_usage and bool(request.stream_options and request.stream_options.continuous_usage_stats)
    return CompletionJob(greq, request.prompt, bool(request.echo), request.logprobs, continuous)
