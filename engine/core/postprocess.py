"""Final-output processing per candidate: strict-grammar checks and tool-call extraction."""

from __future__ import annotations

from typing import Any

from engine.core.sequence import Sequence
from engine.errors import EngineError
from engine.text.tool_parser import parse_tool_calls


class OutputPostprocessor:
    def __init__(self, tokenizer) -> None:
        self.tokenizer = tokenizer

    def for_sequence(self, seq: Sequence) -> dict[str, Any]:
        params = seq.params
        grammar = params.grammar
        if grammar is not None and grammar.strict and seq.grammar is not None and not seq.grammar.is_terminated():
            # cut short (length) before the grammar completed: the output does not parse
            return {"error": EngineError("MODEL_OUTPUT_PARSE_ERROR",
                                         f"the output ended before the {grammar.kind} grammar completed "
                                         "(raise the token limit)", "grammar")}
        if not params.tools or params.tool_choice == "none":
            return {}
        names = {t["function"]["name"] for t in params.tools}
        calls = parse_tool_calls(seq.full_text, names, truncated=seq.finish_reason == "length")
        if not calls:
            return {}
        if params.parallel_tool_calls is False:
            calls = calls[:1]
        if seq.finish_reason == "length":
            # cut off by the token limit after complete calls: they are kept (not read as JSON content) and the
            # finish stays `length`, for each surface to say: chat reports `tool_calls` (docs/contract.md,
            # "Chat completions: responses"), a Response is `incomplete` (OpenAI's max_output_tokens)
            return {"tool_calls": calls}
        return {"tool_calls": calls, "finish_reason": "tool_calls"}
