"""Incremental detokenisation and stop strings, with the real SmolLM2 tokenizer (byte-level BPE)."""

from __future__ import annotations

import pytest

from engine.text.detokenizer import IncrementalDetokenizer


def stream(tokenizer, text: str, stop: list[str]) -> tuple[IncrementalDetokenizer, list[str], list[int]]:
    """Feed `text` token by token; returns the detokenizer, each step's released delta and the token ids."""
    ids = tokenizer.encode(text, add_special_tokens=False)
    detok = IncrementalDetokenizer(tokenizer, stop)
    deltas = []
    for token in ids:
        deltas.append(detok.add_token(token))
        if detok.matched_stop is not None:
            break
    return detok, deltas, ids


def token_pieces(tokenizer, ids: list[int]) -> list[str]:
    return [tokenizer.decode([t]) for t in ids]


def test_plain_text_streams_back_exactly(tokenizer):
    text = "The quick brown fox jumps over the lazy dog. It was 42 degrees!"
    detok, deltas, _ = stream(tokenizer, text, [])
    assert "".join(deltas) + detok.flush() == text
    assert "".join(deltas) == text  # nothing held back without stop strings


def test_stop_string_split_over_several_tokens_is_trimmed_and_never_released(tokenizer):
    text = "Here is the answer. ###END### and then more text that must not appear"
    stop = "###END###"
    ids = tokenizer.encode(text, add_special_tokens=False)
    # the stop string really is spread over several tokens
    pieces = token_pieces(tokenizer, ids)
    assert sum(1 for p in pieces if p.strip() and p.strip() in stop) >= 2
    detok, deltas, _ = stream(tokenizer, text, [stop])
    released = "".join(deltas)
    assert detok.matched_stop == stop
    assert released == "Here is the answer. "
    # at every step what was released so far is a prefix of the trimmed text: no part of the stop leaked
    so_far = ""
    for d in deltas:
        so_far += d
        assert "Here is the answer. ".startswith(so_far)
        assert "#" not in so_far


def test_first_matching_stop_wins_and_is_reported(tokenizer):
    text = "alpha beta gamma delta"
    detok, deltas, _ = stream(tokenizer, text, ["delta", "beta g"])
    assert detok.matched_stop == "beta g"
    assert "".join(deltas) == "alpha "


def test_stop_string_inside_a_single_token(tokenizer):
    text = "Hello world"
    detok, deltas, _ = stream(tokenizer, text, ["llo"])
    assert detok.matched_stop == "llo"
    assert "".join(deltas) == "He"


@pytest.mark.parametrize("text", ["café 😀 naïve", "Привет, мир! 👋🏽", "日本語のテキスト", "x😀😀y"])
def test_multibyte_characters_are_never_emitted_half(tokenizer, text):
    ids = tokenizer.encode(text, add_special_tokens=False)
    # byte-level BPE splits these characters over several tokens: single tokens decode to U+FFFD
    assert any("\ufffd" in p for p in token_pieces(tokenizer, ids))
    _detok, deltas, _ = stream(tokenizer, text, [])
    for d in deltas:
        assert "\ufffd" not in d
    assert "".join(deltas) == text


def test_multibyte_text_with_a_stop_string(tokenizer):
    text = "Voilà 😀 fin ici 🎉 après"
    detok, deltas, _ = stream(tokenizer, text, [" ici 🎉"])
    assert detok.matched_stop == " ici 🎉"
    assert "".join(deltas) == "Voilà 😀 fin"
    assert all("\ufffd" not in d for d in deltas)


def test_held_back_stop_prefix_is_released_when_the_sequence_ends(tokenizer):
    text = "The total is 42 ##"
    detok, deltas, _ = stream(tokenizer, text, ["##END"])
    assert detok.matched_stop is None
    released = "".join(deltas)
    assert released == "The total is 42 "  # "##" could still begin the stop string: held
    assert detok.flush() == "##"
    assert detok.flush() == ""


def test_held_back_prefix_released_once_it_cannot_match(tokenizer):
    text = "a ## b"
    detok, deltas, _ = stream(tokenizer, text, ["##END"])
    assert detok.matched_stop is None
    assert "".join(deltas) + detok.flush() == text
    assert "".join(deltas).startswith("a ##")  # released as soon as " b" ruled the match out


def test_special_tokens_are_not_rendered(tokenizer):
    eos = tokenizer.eos_token_id
    detok = IncrementalDetokenizer(tokenizer, [])
    out = "".join(detok.add_token(t) for t in [*tokenizer.encode("Hi", add_special_tokens=False), eos])
    assert out == "Hi"


@pytest.mark.parametrize("text", ["x😀", "Привет", "日本"])
def test_a_sequence_ending_inside_a_character_ends_with_what_the_tokenizer_decodes(tokenizer, text):
    """Cut mid-character (max_tokens, EOS), the held-back bytes are not dropped: the text ends with what a
    full decode of the ids gives (U+FFFD for the partial character), as OpenAI and vLLM return."""
    ids = tokenizer.encode(text, add_special_tokens=False)
    cut = next(k for k in range(1, len(ids) + 1) if tokenizer.decode(ids[:k]).endswith("\ufffd"))
    detok = IncrementalDetokenizer(tokenizer, [])
    released = "".join(detok.add_token(t) for t in ids[:cut])
    assert released + detok.flush() == tokenizer.decode(ids[:cut])
    assert detok.flush() == ""
