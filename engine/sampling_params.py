"""Per-request sampling settings, parsed from the `sampling_parameters` JSON tensor."""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from engine.errors import invalid

MAX_TOP_LOGPROBS = 20
I64_MIN, I64_MAX = -(2**63), 2**63 - 1
GRAMMAR_KINDS = frozenset({"json_schema", "json_object", "regex", "ebnf"})

# The keys Triton's vLLM backend (r24.10, the Triton 2.51 release we run) parses from strings with
# `int(...)`, `float(...)` and `bool(...)`; its other keys (length_penalty, skip_special_tokens,
# use_beam_search) are not parameters of this engine. Booleans take only true/false/1/0 words here:
# vLLM's `bool("false")` is True, which no client means.
VLLM_INT_KEYS = frozenset({"best_of", "max_tokens", "min_tokens", "n", "top_k"})
VLLM_FLOAT_KEYS = frozenset({"frequency_penalty", "presence_penalty", "temperature", "top_p"})
VLLM_BOOL_KEYS = frozenset({"ignore_eos"})
_BOOL_WORDS = {"true": True, "1": True, "false": False, "0": False}


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
    def reads_logprobs(self) -> bool:
        """The chosen tokens' logprobs are read: reported, or summed to rank best_of candidates."""
        return self.logprobs or self.width > self.n

    @property
    def greedy(self) -> bool:
        return self.temperature <= 0.0

    @property
    def forces_tool_call(self) -> bool:
        """tool_choice "required" or a named function: the output is constrained to a tool call
        (engine/inputs/tool_grammar.py)."""
        return bool(self.tools) and self.tool_choice not in (None, "auto", "none")

    @property
    def uses_penalties(self) -> bool:
        return self.repetition_penalty != 1.0 or self.presence_penalty != 0.0 or self.frequency_penalty != 0.0

    @classmethod
    def from_dict(cls, raw: dict[str, Any], defaults: dict[str, Any] | None = None) -> SamplingParams:
        """Parse and check types and ranges: the Triton model is also driven without the gateway (Triton's
        own clients, genai-perf), so a bad value must be a clear `invalid_request` naming it, never a crash."""
        if not isinstance(raw, dict):
            raise invalid("sampling_parameters must be a JSON object", "sampling_parameters")
        given = {k: coerce_vllm_string(k, v) for k, v in raw.items() if v is not None}
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
        for key, value in merged.items():
            _check_type(key, value)
        grammar = merged.pop("grammar", None)
        bias = merged.pop("logit_bias", None) or {}
        stop = merged.pop("stop", None)
        params = cls(**merged)
        params.logit_bias = _logit_bias(bias)
        params.stop = [stop] if isinstance(stop, str) else list(stop or [])
        params.stop_token_ids = list(params.stop_token_ids)
        if grammar is not None:
            params.grammar = _grammar(grammar)
        # a cap the client did not set is a default: it is clamped to the context, never an error
        params.clamp_max_tokens = params.clamp_max_tokens or "max_tokens" not in given
        params._check()
        return params

    def _check(self) -> None:
        """Ranges (types were checked by `_check_type`)."""
        if self.max_tokens < 1:
            raise invalid("max_tokens must be a positive integer", "max_tokens")
        if not math.isfinite(self.temperature) or self.temperature < 0:
            raise invalid("temperature must be >= 0", "temperature")
        if not 0 < self.top_p <= 1:
            raise invalid("top_p must be in (0, 1]", "top_p")
        if self.top_k < 0:
            raise invalid("top_k must be >= 0 (0 = off)", "top_k")
        if self.min_tokens < 0:
            raise invalid("min_tokens must be >= 0", "min_tokens")
        for name in ("presence_penalty", "frequency_penalty"):
            if not -2 <= getattr(self, name) <= 2:
                raise invalid(f"{name} must be in [-2, 2]", name)
        if not (math.isfinite(self.repetition_penalty) and self.repetition_penalty > 0):
            raise invalid("repetition_penalty must be > 0", "repetition_penalty")
        if not 0 <= self.top_logprobs <= MAX_TOP_LOGPROBS:
            raise invalid(f"top_logprobs must be in [0, {MAX_TOP_LOGPROBS}]", "top_logprobs")
        if self.n < 1:
            raise invalid("n must be >= 1", "n")
        if self.best_of is not None and self.best_of < self.n:
            raise invalid("best_of must be >= n", "best_of")
        if self.seed is not None and not I64_MIN <= self.seed <= I64_MAX:
            raise invalid("seed must be a signed 64-bit integer", "seed")
        if any(not s for s in self.stop):
            raise invalid("stop strings must not be empty", "stop")
        if any(t < 0 for t in self.stop_token_ids):
            raise invalid("stop_token_ids must be non-negative token ids", "stop_token_ids")
        if self.min_tokens > self.max_tokens:
            self.min_tokens = self.max_tokens


def coerce_vllm_string(key: str, value: Any) -> Any:
    """Numeric strings where Triton's vLLM backend parses them (genai-perf sends `{"max_tokens": "32"}`);
    every other key, and every non-string value, is left for the strict checks."""
    if not isinstance(value, str):
        return value
    text = value.strip()
    try:
        if key in VLLM_INT_KEYS:
            return int(text)
        if key in VLLM_FLOAT_KEYS:
            number = float(text)
            return number if math.isfinite(number) else value
    except ValueError:
        return value  # left as a string: the type check names the parameter
    if key in VLLM_BOOL_KEYS and text.lower() in _BOOL_WORDS:
        return _BOOL_WORDS[text.lower()]
    return value


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value: Any) -> bool:
    return _is_int(value) or (isinstance(value, float) and math.isfinite(value))


def _is_str_list(value: Any) -> bool:
    return isinstance(value, list) and all(isinstance(v, str) for v in value)


_TYPE_RULES: dict[str, tuple[Callable[[Any], bool], str]] = {
    **{k: (_is_int, "an integer") for k in (
        "max_tokens", "min_tokens", "top_k", "top_logprobs", "n", "best_of", "seed")},
    **{k: (_is_number, "a finite number") for k in (
        "temperature", "top_p", "repetition_penalty", "presence_penalty", "frequency_penalty")},
    **{k: (lambda v: isinstance(v, bool), "a boolean") for k in (
        "logprobs", "ignore_eos", "include_reasoning", "clamp_max_tokens", "parallel_tool_calls")},
    "stop": (lambda v: isinstance(v, str) or _is_str_list(v), "a string or a list of strings"),
    "stop_token_ids": (lambda v: isinstance(v, list) and all(_is_int(t) for t in v), "a list of token ids"),
    "logit_bias": (lambda v: isinstance(v, dict), "an object of token id -> bias"),
    "lora_adapter": (lambda v: isinstance(v, str), "a string"),
    "max_tokens_param": (lambda v: isinstance(v, str), "a string"),
    "grammar": (lambda v: isinstance(v, dict), "an object"),
    "tools": (lambda v: isinstance(v, list) and all(isinstance(t, dict) for t in v), "a list of objects"),
    "tool_choice": (lambda v: isinstance(v, (str, dict)), "a string or an object"),
    "chat_template_kwargs": (lambda v: isinstance(v, dict), "an object"),
}


def _check_type(key: str, value: Any) -> None:
    if value is None:
        return
    rule = _TYPE_RULES.get(key)
    if rule is not None and not rule[0](value):
        raise invalid(f"{key} must be {rule[1]}", key)


def _logit_bias(bias: dict[Any, Any]) -> dict[int, float]:
    out: dict[int, float] = {}
    for key, value in bias.items():
        token = key if _is_int(key) else int(key) if isinstance(key, str) and key.strip().isdigit() else -1
        if token < 0:
            raise invalid("logit_bias keys must be token ids", "logit_bias")
        if not _is_number(value) or not -100 <= value <= 100:
            raise invalid("logit_bias values must be numbers in [-100, 100]", "logit_bias")
        out[token] = float(value)
    return out


def _grammar(raw: dict[str, Any]) -> GrammarRequest:
    extra = sorted(set(raw) - {"kind", "value", "label", "strict"})
    if extra:
        raise invalid(f"unknown grammar field '{extra[0]}'", "grammar")
    if raw.get("kind") not in GRAMMAR_KINDS:
        raise invalid(f"grammar.kind must be one of {', '.join(sorted(GRAMMAR_KINDS))}", "grammar")
    if raw.get("label") is not None and not isinstance(raw["label"], str):
        raise invalid("grammar.label must be a string", "grammar")
    if not isinstance(raw.get("strict", False), bool):
        raise invalid("grammar.strict must be a boolean", "grammar")
    return GrammarRequest(raw["kind"], raw.get("value"), raw.get("label"), raw.get("strict", False))
