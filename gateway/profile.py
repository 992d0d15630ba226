"""What the gateway knows about a served model: its profile, read from the Triton model config."""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, field

from contract.profile import parse_profile


def sie_safe_id(canonical: str) -> str:
    """`org/name` -> `org__name` (the SIE-safe form used in URL paths)."""
    return canonical.replace("/", "__")


def canonical_id(sie_id: str) -> str:
    """`org__name` -> `org/name`; `_dot_` -> `.` (the SDK leaves dots alone, so both work)."""
    return sie_id.replace("__", "/").replace("_dot_", ".")


@dataclass(frozen=True)
class ModelProfile:
    name: str  # canonical id, e.g. HuggingFaceTB/SmolLM2-135M-Instruct
    triton_model: str  # Triton model name in the repository
    max_output_tokens: int = 4096
    lora_adapters: frozenset[str] = frozenset()
    image_input: bool = False
    grammar_kinds: frozenset[str] = frozenset()
    reasoning: bool = False
    streaming: bool = True
    context_length: int | None = None  # KV positions per sequence (prompt + output), when the profile says
    # the profile's `default_sampling` temperature and top_p: what the engine samples with when a request sets none
    default_temperature: float | None = None
    default_top_p: float | None = None
    # SHA-256 of the model's served config (its Triton name and `parameters`): `X-SIE-Model-Revision` on buffered
    # native answers, so a client can tell which configuration answered it (docs/contract.md, "Response headers")
    revision: str = field(default="", compare=False)
    # the model declares the `cache_salt` input (docs/triton-contract.md): it can keep tenants' prefix caches apart
    cache_salt_input: bool = False
    # the model declares the `tenant` input: its engine can share capacity fairly between tenants
    tenant_input: bool = False

    @property
    def sie_id(self) -> str:
        return sie_safe_id(self.name)

    @classmethod
    def from_triton_config(cls, triton_model: str, parameters: dict[str, str],
                           inputs: frozenset[str] = frozenset()) -> ModelProfile:
        """Build a profile from a model config's `parameters` (string values, as Triton stores them) and the names
        of the inputs it declares.

        Raises contract.profile.ProfileError, naming the key, for an unknown key or a bad value."""
        p = parse_profile(parameters, reader="gateway")
        return cls(
            name=p.served_name or triton_model,
            triton_model=triton_model,
            max_output_tokens=p.max_output_tokens,
            lora_adapters=frozenset(p.lora_paths),
            image_input=p.image_input,
            grammar_kinds=frozenset(p.grammar_kinds),
            reasoning=p.reasoning,
            streaming=p.streaming,
            context_length=p.context_length if parameters.get("context_length", "").strip() else None,
            default_temperature=_number(p.default_sampling.get("temperature")),
            default_top_p=_number(p.default_sampling.get("top_p")),
            revision=hashlib.sha256(json.dumps([triton_model, parameters], sort_keys=True).encode()).hexdigest(),
            cache_salt_input="cache_salt" in inputs,
            tenant_input="tenant" in inputs,
        )


def _number(value: object) -> float | None:
    return float(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else None
