"""Extract OpenAI-style tool calls from generated text.

Accepted forms: a JSON array of `{"name", "arguments"}` objects (our model-agnostic format), a
single such object (text after the leading JSON value is ignored), and Hermes/Qwen-style
`<tool_call>{...}</tool_call>` blocks. The text must start with the call (after whitespace); only
declared function names count as calls.
"""

from __future__ import annotations

import json
import re
import uuid
from typing import Any

_DECODER = json.JSONDecoder()
_TAGGED = re.compile(r"<tool_call>\s*(\{.*?\})\s*</tool_call>", re.DOTALL)


def _as_calls(value: Any) -> list[dict[str, Any]]:
    items = value if isinstance(value, list) else [value]
    calls = []
    for item in items:
        if not isinstance(item, dict) or not isinstance(item.get("name"), str):
            return []
        args = item.get("arguments", item.get("parameters", {}))
        calls.append((item["name"], args if isinstance(args, str) else json.dumps(args)))
    return [
        {"id": f"call_{uuid.uuid4().hex[:24]}", "type": "function", "function": {"name": n, "arguments": a}}
        for n, a in calls
    ]


def parse_tool_calls(text: str, known_names: set[str]) -> list[dict[str, Any]]:
    """Return tool calls found in `text` (only for declared function names), else []."""
    candidates: list[Any] = []
    # a call is the start of the text, never text after prose: so a streaming client can be sent
    # any text that cannot start a call at once (gateway/render/tool_holdback.py mirrors this rule)
    tagged = _TAGGED.findall(text) if text.lstrip().startswith("<tool_call>") else []
    if tagged:
        for block in tagged:
            try:
                candidates.append(json.loads(block))
            except json.JSONDecodeError:
                return []
    else:
        stripped = text.strip()
        if not stripped.startswith(("[", "{")):
            return []
        try:
            # the leading JSON value is the call; small models often ramble on after it
            value, _ = _DECODER.raw_decode(stripped)
        except json.JSONDecodeError:
            return []
        candidates = [value]
    calls = [c for value in candidates for c in _as_calls(value)]
    if not calls or any(c["function"]["name"] not in known_names for c in calls):
        return []
    return calls
