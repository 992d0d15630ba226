"""Incremental detokenisation and stop-string handling for one sequence.

Text is only released once it is stable: a trailing U+FFFD (an incomplete multi-byte character)
is held back, and so is any suffix that could be the start of a stop string. A matched stop
string is trimmed and never leaks into a stream.
"""

from __future__ import annotations

from engine.text.stop_strings import StopMatcher


class IncrementalDetokenizer:
    def __init__(self, tokenizer, stop: list[str], context: list[int] | None = None) -> None:
        """`context`: the prompt's last few ids. Decoding the first new token after them keeps what
        a decoder strips at the start of a text (the leading space of SentencePiece/Metaspace tokens),
        as vLLM's incremental detokenizer does."""
        self.tokenizer = tokenizer
        stops = [s for s in stop if s]
        self.stop = StopMatcher(stops) if stops else None
        self.token_ids: list[int] = list(context or [])
        self.prefix_offset = 0
        self.read_offset = len(self.token_ids)
        self.pending = ""  # decoded but not yet released (could begin a stop string)
        self.matched_stop: str | None = None

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=True)

    def add_token(self, token_id: int, check_stop: bool = True) -> str:
        """Feed one token; returns the newly released text (possibly empty).

        `check_stop` False (before min_tokens): stop strings are not matched in this token's text, and a
        later match must end in text decoded after it, as vLLM's check only looks at the new text."""
        self.token_ids.append(token_id)
        prefix = self._decode(self.token_ids[self.prefix_offset : self.read_offset])
        full = self._decode(self.token_ids[self.prefix_offset :])
        if len(full) <= len(prefix) or full.endswith("\ufffd"):
            return ""
        self.prefix_offset = self.read_offset
        self.read_offset = len(self.token_ids)
        return self._release(full[len(prefix) :], check_stop)

    def _release(self, new_text: str, check_stop: bool) -> str:
        self.pending += new_text
        if self.stop is None:
            out, self.pending = self.pending, ""
            return out
        hit = self.stop.feed(new_text, check_stop)
        if hit is not None:
            end, stop = hit
            self.matched_stop = stop
            out = self.pending[: len(self.pending) - len(new_text) + end - len(stop)]
            self.pending = ""
            return out
        keep = len(self.pending) - self.stop.held  # what cannot begin a stop string any more
        out, self.pending = self.pending[:keep], self.pending[keep:]
        return out

    def flush(self) -> str:
        """Release what was held back once the sequence ends without a stop-string match: a possible stop
        prefix, and the bytes of a character the sequence ended inside, as the tokenizer decodes them
        (U+FFFD), which is what OpenAI and vLLM return and what a full decode of the ids gives."""
        prefix = self._decode(self.token_ids[self.prefix_offset : self.read_offset])
        full = self._decode(self.token_ids[self.prefix_offset :])
        self.prefix_offset = self.read_offset = len(self.token_ids)
        out, self.pending = self.pending + full[len(prefix) :], ""
        return out
