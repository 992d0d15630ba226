"""Per-request sampling settings, parsed from the `sampling_parameters` JSON tensor."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

from engine.errors import invalid

MAX_TOP_LOGPROBS = 20


@dataclass
class GrammarRequest:
    kind: str  # json_schema | json_object | regex | ebnf
    value: Any
    label: str | None = None
    strict: bool = False


@dataclass
class SamplingParams:
    max_tokens: int = 1024
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 = disabled
    min_tokens: int = 0
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: dict[int, float] = field(default_factory=dict)
    seed: int | None = None
    stop: list[str] = field(default_factory=list)
    logprobs: bool = False
    top_logprobs: int = 0
    n: int = 1
    best_of: int | None = None
    ignore_eos: bool = False
    lora_adapter: str | None = None
    grammar: GrammarRequest | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: Any = None
    parallel_tool_calls: bool | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    include_reasoning: bool = False
    stop_token_ids: list[int] = field(default_factory=list)  # end the candidate like EOS (native stop_tokens)
    max_tokens_param: str = "max_tokens"  # the client's name for the cap, for context_exceeded errors
    clamp_max_tokens: bool = False  # the cap is a default, not the client's: clamp it to the context left

    @property
    def width(self) -> int:
        """How many sequences the request runs at once."""
        return max(self.n, self.best_of or 1)

    @property
    def greedy(self) -> bool:
        return self.temperature <= 0.0

    @property
    def uses_penalties(self) -> bool:
        return self.repetition_penalty != 1.0 or self.presence_penalty != 0.0 or self.frequency_penalty != 0.0

    @classmethod
    def from_dict(cls, raw: dict[str, Any], defaults: dict[str, Any] | None = None) -> SamplingParams:
        """Parse and sanity-check (the gateway validates the contract; this guards the engine itself)."""
        given = {k: v for k, v in raw.items() if v is not None}
        merged = {**(defaults or {}), **given}
        if given.get("grammar") is not None or given.get("tool_choice") == "required" \
                or isinstance(given.get("tool_choice"), dict):
            # constrained output: greedy and unpenalised unless the caller asked otherwise
            for key in ("temperature", "presence_penalty", "frequency_penalty"):
                if key not in given:
                    merged[key] = 0.0
        known = set(cls.__dataclass_fields__)
        unknown = sorted(set(merged) - known)
        if unknown:
            raise invalid(f"unknown sampling parameter '{unknown[0]}'", unknown[0])
        grammar = merged.pop("grammar", None)
        bias = merged.pop("logit_bias", None) or {}
        params = cls(**merged)
        try:
            params.logit_bias = {int(k): float(v) for k, v in bias.items()}
        except (TypeError, ValueError, AttributeError):
            raise invalid("logit_bias keys must be token ids", "logit_bias") from None
        if grammar is not None:
            params.grammar = GrammarRequest(**grammar)
        # a cap the client did not set is a default: it is clamped to the context, never an error
        params.clamp_max_tokens = params.clamp_max_tokens or "max_tokens" not in given
        params._check()
        return params

    def _check(self) -> None:
        if not isinstance(self.max_tokens, int) or self.max_tokens < 1:
            raise invalid("max_tokens must be a positive integer", "max_tokens")
        if not math.isfinite(self.temperature) or self.temperature < 0:
            raise invalid("temperature must be >= 0", "temperature")
        if not 0 < self.top_p <= 1:
            raise invalid("top_p must be in (0, 1]", "top_p")
        if self.top_k < 0:
            raise invalid("top_k must be >= 1", "top_k")
        if not 0 <= self.top_logprobs <= MAX_TOP_LOGPROBS:
            raise invalid("top_logprobs must be in [0, 20]", "top_logprobs")
        if self.n < 1 or (self.best_of is not None and self.best_of < self.n):
            raise invalid("best_of must be >= n", "best_of")
        if self.min_tokens > self.max_tokens:
            self.min_tokens = self.max_tokens
