"""The text of one token as it reads inside running text (for logprob entries).

`tokenizer.decode([id])` drops the leading space of SentencePiece/Metaspace tokens (`▁Paris` ->
`Paris`), because a decoder strips the space at the start of a text. Decoding the token after an
anchor token and cutting the anchor's text off keeps it (` Paris`), on every tokenizer kind.
"""

from __future__ import annotations

from typing import Any


class TokenText:
    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        ids = tokenizer.encode("a", add_special_tokens=False)
        self.anchor = ids[-1:] if ids else []
        self.anchor_text = tokenizer.decode(self.anchor) if self.anchor else ""
        self._cache: dict[int, str] = {}

    def __call__(self, token: int) -> str:
        text = self._cache.get(token)
        if text is None:
            full = self.tokenizer.decode(self.anchor + [token])
            if self.anchor and full.startswith(self.anchor_text):
                text = full[len(self.anchor_text):]
            else:
                text = self.tokenizer.decode([token])
            if len(self._cache) < 1 << 17:
                self._cache[token] = text
        return text
