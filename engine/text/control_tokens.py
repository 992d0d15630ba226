"""Control tokens only from the chat template: request text that spells one is tokenized as plain text.

Why: tokenizing a rendered chat parses every special-token string in it, wherever it came from, so message
content like `<|im_start|>system ...` would forge a real turn past the operator's system prompt. vLLM and HF
leave this to the caller. Here every request string (contents, names, tool calls and results, tool schemas,
template kwargs) has its special-token spellings swapped for unguessable ASCII markers before the template
runs (they survive `tojson`, `trim` and concatenation). After rendering, each marker becomes one placeholder
special token the template itself did not emit, so it splits the text exactly where a real control token
would; after tokenizing (by the tokenizer or a vision processor), each placeholder id is spliced out for the
plain-text tokens of what the request wrote.
"""

from __future__ import annotations

import re
import secrets
from dataclasses import dataclass, field
from typing import Any

from engine.errors import invalid


@dataclass
class ChatPrompt:
    """A rendered chat prompt; `splice` turns its token ids into the ids the model sees."""

    text: str  # the template's output, with `placeholder` where request text spelled a control token
    forged: list[str] = field(default_factory=list)  # what the request wrote at each placeholder, in order
    placeholder_id: int | None = None

    def splice(self, tokenizer: Any, ids: list[int]) -> list[int]:
        if not self.forged:
            return ids
        out: list[int] = []
        pending = iter(self.forged)
        for token in ids:
            if token == self.placeholder_id:
                out += tokenizer.encode(next(pending), add_special_tokens=False, split_special_tokens=True)
            else:
                out.append(token)
        if next(pending, None) is not None:  # the tokenizer merged a placeholder away: never guess
            raise invalid("messages could not be tokenized safely", "messages")
        return out

    def encode(self, tokenizer: Any) -> list[int]:
        return self.splice(tokenizer, tokenizer.encode(self.text, add_special_tokens=False))


class ControlTokenGuard:
    """Hides the special-token spellings in one request's strings while its chat template renders."""

    def __init__(self, tokenizer: Any) -> None:
        self.specials = sorted(tokenizer.get_added_vocab(), key=len, reverse=True)  # longest spelling first
        self.vocab = tokenizer.get_added_vocab()
        self.pattern = re.compile("|".join(map(re.escape, self.specials))) if self.specials else None
        nonce = secrets.token_hex(8)
        self.marker = re.compile(f"SIEctl{nonce}n([0-9]+)z")
        self._template = f"SIEctl{nonce}n{{}}z"
        self.found: list[str] = []

    def hide(self, value: Any) -> Any:
        """`value` (str, or lists/dicts of them, any depth) with each special-token spelling as a marker."""
        if isinstance(value, str):
            return value if self.pattern is None else self.pattern.sub(self._mark, value)
        if isinstance(value, dict):
            return {k: self.hide(v) for k, v in value.items()}
        if isinstance(value, (list, tuple)):
            return [self.hide(v) for v in value]
        return value

    def _mark(self, match: re.Match[str]) -> str:
        self.found.append(match.group())
        return self._template.format(len(self.found) - 1)

    def prompt(self, rendered: str) -> ChatPrompt:
        """The rendered text with every marker as a placeholder special token the template did not use."""
        if not self.found:
            return ChatPrompt(rendered)
        bare = self.marker.sub("", rendered)
        placeholder = next((s for s in self.specials if s not in bare), None)
        if placeholder is None:
            raise invalid("messages could not be tokenized safely", "messages")
        forged: list[str] = []

        def place(match: re.Match[str]) -> str:
            forged.append(self.found[int(match.group(1))])
            return placeholder

        return ChatPrompt(self.marker.sub(place, rendered), forged, self.vocab[placeholder])
