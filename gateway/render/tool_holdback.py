"""Streaming content when tools are offered: release text as soon as it cannot start a tool call.

The engine recognises a call only at the start of a choice's text (after whitespace): a JSON array or
object, or a `<tool_call>` block (engine/text/tool_parser.py). So, like vLLM's streaming tool parsers, the
renderer holds back only a leading part that could still become one of those, and streams everything
else as it arrives. Text that starts like a call stays held until the choice closes: then it is either
the call (sent as `tool_calls`) or plain content after all.
"""

from __future__ import annotations

_TAG = "<tool_call>"
_CALL_STARTS = ("[", "{", _TAG)


def could_start_tool_call(text: str) -> bool:
    """Whether `text` (a choice's text so far) may still turn out to be a tool call."""
    head = text.lstrip()
    return not head or head.startswith(_CALL_STARTS) or _TAG.startswith(head)


class ToolHoldback:
    """Per-choice hold-back: `feed` returns the text to stream now, `close` what is still held."""

    def __init__(self) -> None:
        self._held: dict[int, list[str]] = {}
        self._released: set[int] = set()  # choices whose text can no longer be a call

    def feed(self, index: int, text: str) -> str:
        if index in self._released or not text:
            return text
        held = self._held.setdefault(index, [])
        held.append(text)
        joined = "".join(held)
        if could_start_tool_call(joined):
            if len(held) > 1:
                held[:] = [joined]  # keep one string, not one per token
            return ""
        del self._held[index]
        self._released.add(index)
        return joined

    def close(self, index: int) -> str:
        self._released.discard(index)
        return "".join(self._held.pop(index, []))
