"""Prompt rendering: chat messages through the model's own chat template, tools included."""

from __future__ import annotations

import json
from typing import Any

from engine.errors import invalid
from engine.text.control_tokens import ChatPrompt, ControlTokenGuard

TOOLS_SYSTEM_PREAMBLE = (
    "You have access to the following functions. To call one or more, reply with only a JSON array "
    'of objects of the form {"name": <function name>, "arguments": <arguments object>}.\n'
    "Functions:\n"
)


def render_tools_preamble(tools: list[dict[str, Any]]) -> str:
    """Model-agnostic tool description, used when the chat template has no tool format."""
    return TOOLS_SYSTEM_PREAMBLE + "\n".join(json.dumps(t.get("function", t)) for t in tools)


def _template_supports_tools(tokenizer) -> bool:
    template = getattr(tokenizer, "chat_template", None) or ""
    return "tools" in template


def _normalise(messages: list[dict[str, Any]], inline_tools: bool) -> list[dict[str, Any]]:
    """Make replayed tool turns renderable by templates that only know plain string content."""
    out = []
    for m in messages:
        m = dict(m)
        if m.get("role") == "developer":
            m["role"] = "system"
        if inline_tools and m.get("tool_calls"):
            calls = [
                {"name": c["function"]["name"], "arguments": json.loads(c["function"]["arguments"] or "{}")}
                for c in m["tool_calls"]
            ]
            m["content"] = (m.get("content") or "") + json.dumps(calls)
            m.pop("tool_calls")
        if m.get("content") is None:
            m["content"] = ""
        if inline_tools and m.get("role") == "tool":
            m = {"role": "user", "content": f"Function result ({m.get('tool_call_id', '')}): {m['content']}"}
        out.append(m)
    return out


def render_chat(
    tokenizer,
    messages: list[dict[str, Any]],
    tools: list[dict[str, Any]] | None = None,
    template_kwargs: dict[str, Any] | None = None,
    *,
    add_generation_prompt: bool = True,
    continue_final_message: bool = False,
) -> ChatPrompt:
    """Render messages into the prompt the model continues from; only the template makes control tokens.

    The two flags are for `/tokenize` (vLLM's options); a generation always opens the assistant's turn."""
    if not messages:
        raise invalid("messages must not be empty", "messages")
    if not getattr(tokenizer, "chat_template", None):
        raise invalid("this model has no chat template (a base model): send the text as a prompt to /v1/completions "
                      "or native generate instead", "messages")
    guard = ControlTokenGuard(tokenizer)
    messages, tools, template_kwargs = guard.hide(messages), guard.hide(tools), guard.hide(template_kwargs)
    native_tools = bool(tools) and _template_supports_tools(tokenizer)
    messages = _normalise(messages, inline_tools=not native_tools)
    if tools and not native_tools:
        preamble = render_tools_preamble(tools)
        if messages[0]["role"] == "system":
            messages[0] = {**messages[0], "content": messages[0]["content"] + "\n\n" + preamble}
        else:
            messages.insert(0, {"role": "system", "content": preamble})
    kwargs = dict(template_kwargs or {})
    try:
        rendered = tokenizer.apply_chat_template(
            messages,
            tools=tools if native_tools else None,
            add_generation_prompt=add_generation_prompt,
            continue_final_message=continue_final_message,
            tokenize=False,
            **kwargs,
        )
    except Exception as exc:  # template errors are the request's fault (bad turn order, ...)
        raise invalid(f"messages could not be rendered with the model's chat template: {exc}", "messages") from None
    return guard.prompt(rendered)
