"""Wire-neutral request and event types shared by contracts, router, Triton client and renderers."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True)
class GrammarSpec:
    kind: str  # "json_schema" | "regex" | "ebnf" | "json_object"
    value: Any  # schema dict for json_schema/json_object, str otherwise
    label: str | None = None
    strict: bool = False
    param: str = "grammar"  # the client's field it came from: what an error about it names (not sent to Triton)


@dataclass(frozen=True)
class ImageInput:
    data: bytes  # decoded bytes
    format: str  # e.g. "png", "jpeg"


Prompt = str | tuple[int, ...]  # a completions prompt: text, or token ids taken as they are (OpenAI's, vLLM's forms)


def prompt_fields(prompt: Prompt) -> dict[str, Any]:
    """The GenerationRequest fields that carry one prompt: its text, or its token ids."""
    if isinstance(prompt, str):
        return {"prompt": prompt, "prompt_token_ids": None}
    return {"prompt": None, "prompt_token_ids": prompt}


@dataclass(frozen=True)
class GenerationRequest:
    """A validated generation request, independent of the HTTP contract it came from."""

    model: str  # as the client wrote it (canonical or SIE-safe); resolved by the registry
    max_tokens: int
    max_tokens_param: str  # the field that set max_tokens (for context_exceeded errors)
    max_tokens_defaulted: bool = False  # no field set it: the gateway default, clamped to the model cap
    prompt: str | None = None
    prompt_token_ids: tuple[int, ...] | None = None  # a prompt already tokenized (completions), instead of `prompt`
    messages: tuple[dict[str, Any], ...] | None = None
    stream: bool = False
    include_usage: bool = False
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_tokens: int | None = None
    repetition_penalty: float | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    logit_bias: dict[int, float] | None = None
    seed: int | None = None
    stop: tuple[str, ...] = ()
    logprobs: bool = False
    top_logprobs: int = 0
    n: int = 1
    best_of: int | None = None
    lora_adapter: str | None = None
    ignore_eos: bool = False  # vLLM's extension (completions only): generate max_tokens regardless of EOS
    grammar: GrammarSpec | None = None
    tools: tuple[dict[str, Any], ...] | None = None
    tool_choice: Any = None
    parallel_tool_calls: bool | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    include_reasoning: bool = False
    images: tuple[ImageInput, ...] = ()
    routing_key: str | None = None
    prompt_cache_key: str | None = None
    # the `cache_salt` Triton input: the tenant's prefix-cache scope, set per endpoint by the service (never in a
    # repr, so never in a log line)
    cache_salt: str | None = field(default=None, repr=False)
    # the engine's scheduling (docs/triton-contract.md): `priority` (lower runs earlier) rides in
    # `sampling_parameters`; `tenant` (a keyed hash, None: the one shared tenant) and its fair-share weight are the
    # `tenant` input, set by admission (gateway/admission.py) and sent to models that declare it
    priority: int = 0
    tenant: str | None = field(default=None, repr=False)
    tenant_weight: float = 1.0
    # the client's `user`: with auth off, admission turns it into `tenant`, then drops it. Never sent, never in a repr
    user: str | None = field(default=None, repr=False)
    options: dict[str, Any] | None = None
    profile: str | None = None  # "model:profile" suffix
    # Request path of the first image (`images` or `messages[i].content[j].type`), so a model
    # without image input can name the field at fault.
    image_param: str | None = None
    # Request path of each image's data, in order: the engine names an image it cannot decode `images[i]`
    # (session.attribute maps that to the client's field).
    image_data_params: tuple[str, ...] = ()
    # the client's field for the conversation, where it is not `messages` (`input` on /v1/responses): the engine
    # names `messages` for a prompt it cannot take (context_exceeded), and session.attribute maps it
    messages_param: str = "messages"

    @property
    def forces_tool_call(self) -> bool:
        """`tool_choice` "required" or a named function: the engine's grammar makes every output tool-call syntax,
        so text that did not become a call (cut off before its first call closed) is never an answer."""
        return bool(self.tools) and (self.tool_choice == "required" or isinstance(self.tool_choice, dict))

    def sampling_parameters(self) -> dict[str, Any]:
        """The JSON `sampling_parameters` tensor for the Triton model (see docs/triton-contract.md)."""
        params: dict[str, Any] = {"max_tokens": self.max_tokens, "n": self.n,
                                  "max_tokens_param": self.max_tokens_param}
        if self.max_tokens_defaulted:
            params["clamp_max_tokens"] = True  # no field set the cap: the engine clamps it to the context left
        optional = {
            "temperature": self.temperature,
            "top_p": self.top_p,
            "top_k": self.top_k,
            "min_tokens": self.min_tokens,
            "repetition_penalty": self.repetition_penalty,
            "presence_penalty": self.presence_penalty,
            "frequency_penalty": self.frequency_penalty,
            "seed": self.seed,
            "best_of": self.best_of,
            "lora_adapter": self.lora_adapter,
            "tool_choice": self.tool_choice,
            "parallel_tool_calls": self.parallel_tool_calls,
            "chat_template_kwargs": self.chat_template_kwargs,
        }
        params.update({k: v for k, v in optional.items() if v is not None})
        if self.priority:
            params["priority"] = self.priority  # where the Triton vLLM backend reads it too; absent: 0
        if self.logit_bias:
            params["logit_bias"] = {str(k): v for k, v in self.logit_bias.items()}
        # native `options.stop_tokens`: ids end generation on that token (the engine's `stop_token_ids`);
        # token strings act as stop strings
        stop_tokens = (self.options or {}).get("stop_tokens") or ()
        stop_ids = [t for t in stop_tokens if isinstance(t, int)]
        if stop_ids:
            params["stop_token_ids"] = stop_ids
        stops = [*self.stop, *(t for t in stop_tokens if isinstance(t, str))]
        if stops:
            params["stop"] = stops
        if self.ignore_eos:
            params["ignore_eos"] = True
        if self.logprobs:
            params["logprobs"] = True
            params["top_logprobs"] = self.top_logprobs
        if self.grammar is not None:
            params["grammar"] = {
                "kind": self.grammar.kind,
                "value": self.grammar.value,
                "label": self.grammar.label,
                "strict": self.grammar.strict,
            }
        if self.tools:
            params["tools"] = list(self.tools)
        if self.include_reasoning:
            params["include_reasoning"] = True
        return params


@dataclass
class GenerationEvent:
    """One response from the model: a text delta for one choice, possibly closing it."""

    index: int
    text: str
    finish_reason: str | None = None  # set when this choice is finished
    logprobs: list[dict[str, Any]] | None = None
    tool_calls: list[dict[str, Any]] | None = None  # complete calls (on the closing event)
    reasoning: str | None = None
    prompt_tokens: int = 0
    completion_tokens: int = 0  # completion tokens of this choice so far (on the closing event)
    stop_reason: str | int | None = None  # the stop string matched, or the stop token id
    ttft_ms: float | None = None  # engine timing, on closing events
    tpot_ms: float | None = None
    cached_tokens: int = 0  # prompt tokens served from the engine's prefix cache (closing events)

    @property
    def is_progress(self) -> bool:
        """The engine's first-token marker on blocking requests: nothing to render, only liveness."""
        return not self.text and self.finish_reason is None and not self.logprobs and not self.reasoning \
            and not self.tool_calls


@dataclass
class GenerationResult:
    """Accumulated outcome of one request (blocking paths)."""

    choices: dict[int, dict[str, Any]]
    prompt_tokens: int
    completion_tokens: int
    ttft_ms: float | None
    tpot_ms: float | None
    cached_tokens: int = 0  # of prompt_tokens, from the engine's prefix cache


@dataclass(frozen=True)
class TokenizerTask:
    """`/tokenize` (a prompt, or messages through the chat template) or `/detokenize` (ids), for Triton."""

    prompt: str | None = None
    messages: tuple[dict[str, Any], ...] | None = None
    options: dict[str, Any] | None = None  # add_special_tokens, add_generation_prompt, tools, ...
    detokenize: tuple[int, ...] | None = None


@dataclass(frozen=True)
class TokenizerResult:
    token_ids: list[int]
    text: str  # the decoded text (detokenize)
    max_model_len: int
    token_strs: list[str] | None = None
