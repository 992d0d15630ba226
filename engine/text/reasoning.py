"""Split a reasoning model's output into reasoning text (inside `<think>...</think>`) and content.

Incremental: tags may arrive split across deltas, so any suffix that could start a tag is held
back until the next delta (or the end) decides it. Used only for models whose profile declares
reasoning; the reasoning text is returned only when the request sets `include_reasoning`.
"""

from __future__ import annotations

OPEN, CLOSE = "<think>", "</think>"


class ReasoningSplitter:
    def __init__(self, inside: bool = False) -> None:
        self.inside = inside  # the chat template may already have opened the thinking block
        self.pending = ""

    def feed(self, text: str) -> tuple[str, str]:
        """New released text -> (reasoning delta, content delta)."""
        self.pending += text
        reasoning: list[str] = []
        content: list[str] = []
        while True:
            tag = CLOSE if self.inside else OPEN
            index = self.pending.find(tag)
            if index < 0:
                break
            (reasoning if self.inside else content).append(self.pending[:index])
            self.pending = self.pending[index + len(tag):]
            self.inside = not self.inside
        tag = CLOSE if self.inside else OPEN
        hold = next((n for n in range(min(len(tag) - 1, len(self.pending)), 0, -1)
                     if tag.startswith(self.pending[-n:])), 0)
        ready, self.pending = self.pending[: len(self.pending) - hold], self.pending[len(self.pending) - hold:]
        (reasoning if self.inside else content).append(ready)
        return "".join(reasoning), "".join(content)

    def flush(self) -> tuple[str, str]:
        rest, self.pending = self.pending, ""
        return (rest, "") if self.inside else ("", rest)
