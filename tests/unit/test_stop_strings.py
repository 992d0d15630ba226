"""Stop-string matching (engine.text.stop_strings) against a brute-force reference, and its cost per token."""

from __future__ import annotations

import random
import sys

from engine.text.detokenizer import IncrementalDetokenizer
from engine.text.stop_strings import StopMatcher


def reference(text: str, stops: list[str]) -> tuple[int, str] | None:
    """The stop that ends earliest in `text` (the longest of those ending there): (its end, the stop)."""
    for end in range(1, len(text) + 1):
        ending = [s for s in stops if text[:end].endswith(s)]
        if ending:
            return end, max(ending, key=len)
    return None


def longest_prefix_suffix(text: str, stops: list[str]) -> int:
    return max((k for k in range(len(text) + 1) if any(s.startswith(text[len(text) - k:]) for s in stops)),
               default=0)


def test_matches_and_hold_back_equal_brute_force_over_random_pieces():
    rng = random.Random(7)
    for _ in range(400):
        stops = ["".join(rng.choice("abc") for _ in range(rng.randint(1, 4))) for _ in range(rng.randint(1, 5))]
        text = "".join(rng.choice("abcd") for _ in range(rng.randint(0, 24)))
        matcher = StopMatcher(stops)
        fed, hit = 0, None
        while fed < len(text) and hit is None:  # fed in random pieces, as tokens release text
            piece = text[fed : fed + rng.randint(1, 4)]
            found = matcher.feed(piece)
            if found is not None:
                hit = (fed + found[0], found[1])
            else:
                assert matcher.held == longest_prefix_suffix(text[: fed + len(piece)], stops)
            fed += len(piece)
        assert hit == reference(text, stops), (stops, text)


def test_a_match_that_ended_while_unchecked_is_not_reported_later():
    matcher = StopMatcher(["e", "xyz"])
    assert matcher.feed("the", check=False) is None
    assert matcher.feed("x") is None
    assert matcher.feed("yz!") == (2, "xyz")


def _traced_lines(stops: list[str], pieces: list[str]) -> int:
    """Python line events while a detokenizer releases `pieces` (its construction excluded)."""
    class Decoder:  # a tokenizer whose tokens are the pieces themselves
        @staticmethod
        def decode(ids, skip_special_tokens=True):
            return "".join(pieces[i] for i in ids)

    detok = IncrementalDetokenizer(Decoder(), stops)
    lines = 0

    def tracer(frame, event, arg):
        nonlocal lines
        if event == "line":
            lines += 1
        return tracer

    sys.settrace(tracer)
    try:
        for i in range(len(pieces)):
            detok.add_token(i)
    finally:
        sys.settrace(None)
    return lines


def test_the_work_per_token_does_not_grow_with_the_number_of_stop_strings():
    """50,000 stop strings once made every token scan all of them on the engine thread, stalling every request."""
    pieces = ["The", " quick", " brown", " fox", " jumps", " over", " the", " lazy", " dog", "."]
    few = [f"<stop{i}>" for i in range(8)]
    many = [f"<stop{i}>" for i in range(800)]
    assert _traced_lines(many, pieces) <= 1.2 * _traced_lines(few, pieces)
