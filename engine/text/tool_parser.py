"""Extract OpenAI-style tool calls from generated text.

Accepted forms: a JSON array of `{"name", "arguments"}` objects (our model-agnostic format), a
single such object (text after the leading JSON value is ignored), and Hermes/Qwen-style
`<tool_call>{...}</tool_call>` blocks. The text must start with the call (after whitespace); only
declared function names count as calls. Output cut off by the token limit keeps the calls it
completed: the complete elements of an unterminated array (and the complete tagged blocks).
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


def _complete_elements(text: str) -> list[Any]:
    """The complete leading elements of a JSON array cut off mid-way (`text` starts with `[`), else [].

    Only a cut that falls inside an element (or between elements) counts: the rest after the last
    complete element must be nothing, or the start of another object, as a token limit leaves it.
    """
    items: list[Any] = []
    pos = 1
    while True:
        while pos < len(text) and text[pos].isspace():
            pos += 1
        if pos == len(text):
            return items
        if not text.startswith("{", pos):
            return []
        try:
            item, pos = _DECODER.raw_decode(text, pos)
        except json.JSONDecodeError:
            return items  # the trailing element was cut off
        items.append(item)
        while pos < len(text) and text[pos].isspace():
            pos += 1
        if pos == len(text):
            return items
        if text[pos] != ",":
            return []  # a complete array would have parsed; this is not one cut short
        pos += 1


def parse_tool_calls(text: str, known_names: set[str], truncated: bool = False) -> list[dict[str, Any]]:
    """Return tool calls found in `text` (only for declared function names), else [].

    `truncated`: the output was cut off by the token limit, so a call array that never closed still
    yields the calls it completed (the incomplete trailing one is dropped).
    """
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
            if not (truncated and stripped.startswith("[")):
                return []
            value = _complete_elements(stripped)
            if not value:
                return []
        candidates = [value]
    calls = [c for value in candidates for c in _as_calls(value)]
    if not calls or any(c["function"]["name"] not in known_names for c in calls):
        return []
    return calls
