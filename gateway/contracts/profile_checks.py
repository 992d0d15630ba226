"""Checks of a validated request against the served model's profile (before dispatch)."""

from __future__ import annotations

from gateway.domain import GenerationRequest
from gateway.errors import ContextExceeded, InvalidRequest, UnknownLoraAdapter, UnsupportedField, quoted
from gateway.profile import ModelProfile

# Chat's json_object mode is compiled as a JSON Schema grammar.
_GRAMMAR_KIND_NEEDED = {"json_object": "json_schema"}


def check_against_profile(req: GenerationRequest, profile: ModelProfile) -> None:
    """Raise the contract error for the first capability or limit of `profile` that `req` breaks.

    Order: LoRA adapter, streaming, images, grammar, output-token cap, min tokens.
    """
    _check_lora(req, profile)
    if req.stream and not profile.streaming:
        raise UnsupportedField(f"model '{profile.name}' does not support 'stream: true'", param="stream")
    if req.images and not profile.image_input:
        raise UnsupportedField(
            f"model '{profile.name}' does not accept image input",
            param=req.image_param or "images",
        )
    _check_grammar(req, profile)
    if req.max_tokens > profile.max_output_tokens:
        raise ContextExceeded(
            f"'{req.max_tokens_param}' ({req.max_tokens}) exceeds the model's output-token "
            f"limit of {profile.max_output_tokens}",
            param=req.max_tokens_param,
        )
    if req.min_tokens is not None and req.min_tokens > req.max_tokens:
        raise InvalidRequest(
            f"'min_tokens' ({req.min_tokens}) must not exceed '{req.max_tokens_param}' ({req.max_tokens})",
            param="min_tokens",
        )


def _check_lora(req: GenerationRequest, profile: ModelProfile) -> None:
    if req.lora_adapter is not None and req.lora_adapter not in profile.lora_adapters:
        raise UnknownLoraAdapter(
            f"unknown LoRA adapter {quoted(req.lora_adapter)} for model '{profile.name}'",
            param="lora_adapter",
        )


def _check_grammar(req: GenerationRequest, profile: ModelProfile) -> None:
    if req.grammar is None:
        return
    kind = _GRAMMAR_KIND_NEEDED.get(req.grammar.kind, req.grammar.kind)
    if kind in profile.grammar_kinds:
        return
    # name what the client asked for, in its own field (chat: response_format, responses: text.format)
    asked = req.grammar.kind
    param = req.grammar.param if req.grammar.param != "grammar" else f"grammar.{asked}"
    raise UnsupportedField(f"model '{profile.name}' does not support '{asked}' constrained output", param=param)
