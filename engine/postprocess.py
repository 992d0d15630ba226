"""Final-output processing per candidate: tool-call extraction (reasoning split lives here too)."""

from __future__ import annotations

from typing import Any

from engine.sequence import Sequence
from engine.tool_parser import parse_tool_calls


class OutputPostprocessor:
    def __init__(self, tokenizer) -> None:
        self.tokenizer = tokenizer

    def for_sequence(self, seq: Sequence) -> dict[str, Any]:
        params = seq.params
        if not params.tools or params.tool_choice == "none":
            return {}
        calls = parse_tool_calls(seq.full_text, {t["function"]["name"] for t in params.tools})
        if not calls:
            return {}
        if params.parallel_tool_calls is False:
            calls = calls[:1]
        return {"tool_calls": calls, "finish_reason": "tool_calls"}
