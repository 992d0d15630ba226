"""Incremental detokenisation and stop-string handling for one sequence.

Text is only released once it is stable: a trailing U+FFFD (an incomplete multi-byte character)
is held back, and so is any suffix that could be the start of a stop string. A matched stop
string is trimmed and never leaks into a stream.
"""

from __future__ import annotations


class IncrementalDetokenizer:
    def __init__(self, tokenizer, stop: list[str], context: list[int] | None = None) -> None:
        """`context`: the prompt's last few ids. Decoding the first new token after them keeps what
        a decoder strips at the start of a text (the leading space of SentencePiece/Metaspace tokens),
        as vLLM's incremental detokenizer does."""
        self.tokenizer = tokenizer
        self.stop = [s for s in stop if s]
        self.max_stop = max((len(s) for s in self.stop), default=0)
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
        checked = len(self.pending)  # what is held was already checked (or exempt): a match must end past it
        self.pending += new_text
        if not self.stop:
            out, self.pending = self.pending, ""
            return out
        cut = _first_stop(self.pending, self.stop, checked) if check_stop else None
        if cut is not None:
            index, stop = cut
            self.matched_stop = stop
            out, self.pending = self.pending[:index], ""
            return out
        hold = _longest_stop_prefix_suffix(self.pending, self.stop, self.max_stop)
        out = self.pending[: len(self.pending) - hold]
        self.pending = self.pending[len(self.pending) - hold :]
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


def _first_stop(text: str, stops: list[str], checked: int) -> tuple[int, str] | None:
    """The earliest stop string in `text` that ends past its first `checked` characters."""
    best: tuple[int, str] | None = None
    for stop in stops:
        index = text.find(stop, max(0, checked - len(stop) + 1))
        if index >= 0 and (best is None or index < best[0]):
            best = (index, stop)
    return best


def _longest_stop_prefix_suffix(text: str, stops: list[str], max_stop: int) -> int:
    """Length of the longest suffix of `text` that is a proper prefix of some stop string."""
    for length in range(min(len(text), max_stop - 1), 0, -1):
        suffix = text[-length:]
        if any(s.startswith(suffix) for s in stops):
            return length
    return 0
