"""`/tokenize` and `/detokenize` on the model's own tokenizer (docs/triton-contract.md, tokenizer requests).

A prompt is encoded as generation encodes it; messages go through the same chat-template rendering (tools,
template kwargs, the control-token guard), with vLLM's `add_generation_prompt` / `continue_final_message`.
"""

from __future__ import annotations

from typing import Any

from engine.errors import invalid
from engine.text.chat import render_chat

_BOOL_OPTIONS = ("add_special_tokens", "add_generation_prompt", "continue_final_message", "return_token_strs")
_OPTIONS = (*_BOOL_OPTIONS, "chat_template_kwargs", "tools")


def _checked(options: Any) -> dict[str, Any]:
    if not isinstance(options, dict):
        raise invalid("tokenize options must be a JSON object", "tokenize")
    for key, value in options.items():
        if key not in _OPTIONS:
            raise invalid(f"unknown tokenize option '{key}'", key)
        if key in _BOOL_OPTIONS and not isinstance(value, bool):
            raise invalid(f"'{key}' must be a boolean", key)
    return options


def tokenize(tokenizer: Any, options: Any, prompt: str | None, messages: list[dict[str, Any]] | None,
             max_len: int, template_kwargs: dict[str, Any] | None = None) -> dict[str, Any]:
    """The `extras` of a tokenize answer: `token_ids`, `max_model_len` and, when asked, `token_strs`."""
    options = _checked(options)
    add_special = options.get("add_special_tokens", messages is None)
    if messages is not None:
        kwargs = {**(options.get("chat_template_kwargs") or {}), **(template_kwargs or {})}
        chat = render_chat(tokenizer, messages, options.get("tools"), kwargs,
                           add_generation_prompt=options.get("add_generation_prompt", True),
                           continue_final_message=options.get("continue_final_message", False))
        ids = chat.splice(tokenizer, tokenizer.encode(chat.text, add_special_tokens=add_special))
    elif prompt is not None:
        ids = tokenizer.encode(prompt, add_special_tokens=add_special)
    else:
        raise invalid("either text_input or messages is required", "prompt")
    extras: dict[str, Any] = {"token_ids": ids, "max_model_len": max_len}
    if options.get("return_token_strs"):
        extras["token_strs"] = tokenizer.convert_ids_to_tokens(ids)
    return extras


def detokenize(tokenizer: Any, ids: list[int], max_len: int) -> tuple[str, dict[str, Any]]:
    """(text, extras) for a detokenize request; an id outside the vocabulary names its position."""
    check_in_vocabulary(tokenizer, ids, "tokens")
    return tokenizer.decode(ids), {"token_ids": ids, "max_model_len": max_len}


def check_in_vocabulary(tokenizer: Any, ids: list[int], param: str) -> None:
    """Every id is a token of this model; the first that is not is named by its position (`param[i]`)."""
    vocab = len(tokenizer)
    for i, token in enumerate(ids):
        if not 0 <= token < vocab:
            raise invalid(f"token id {token} is outside the vocabulary (0..{vocab - 1})", f"{param}[{i}]")
