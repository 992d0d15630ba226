"""Forced tool choice (`required` / a named function) as a JSON-schema grammar over our call format.

The model-agnostic call format is a JSON array of `{"name": ..., "arguments": {...}}` objects
(see engine.text.chat); the grammar guarantees a parseable call with a declared name.
"""

from __future__ import annotations

from typing import Any

from engine.errors import invalid
from engine.sampling_params import GrammarRequest


def _call_schema(function: dict[str, Any]) -> dict[str, Any]:
    params = function.get("parameters") or {"type": "object"}
    return {
        "type": "object",
        "properties": {"name": {"const": function["name"]}, "arguments": params},
        "required": ["name", "arguments"],
        "additionalProperties": False,
    }


def forced_tool_grammar(tools: list[dict[str, Any]], tool_choice: Any, parallel: bool | None) -> GrammarRequest | None:
    """Grammar for `required` or a named function; None when the choice does not force a call."""
    functions = [t["function"] for t in tools]
    if isinstance(tool_choice, dict):
        name = tool_choice.get("function", {}).get("name")
        functions = [f for f in functions if f["name"] == name]
        max_items: int | None = 1
    elif tool_choice == "required":
        max_items = 1 if parallel is False else None
    else:
        return None
    if not functions:
        # the gateway rejects this too; the engine must when it is driven directly (Triton's own clients)
        raise invalid(f"tool_choice {tool_choice!r} matches no function in tools", "tool_choice")
    items = _call_schema(functions[0]) if len(functions) == 1 else {"anyOf": [_call_schema(f) for f in functions]}
    schema: dict[str, Any] = {"type": "array", "items": items, "minItems": 1}
    if max_items is not None:
        schema["maxItems"] = max_items
    return GrammarRequest(kind="json_schema", value=schema, label="tool_call")
