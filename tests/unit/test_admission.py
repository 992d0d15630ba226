"""Admission's pieces: what a request counts against tokens per minute, and the body wrapper that gives a key's slot
back when a stream is closed (also inside the request metrics' own wrapper)."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

from gateway.admission import estimated_tokens
from gateway.domain import GenerationRequest
from gateway.middleware import BodyEnd


def _req(**kw: Any) -> GenerationRequest:
    return GenerationRequest(**{"model": "m", "max_tokens": 10, "max_tokens_param": "max_tokens", **kw})


def test_tokens_are_the_prompt_estimate_plus_every_candidate_s_cap():
    assert estimated_tokens(_req(prompt="x" * 9)) == 3 + 10  # 9 characters: 3 tokens, rounded up
    assert estimated_tokens(_req(prompt_token_ids=(1, 2, 3, 4, 5))) == 5 + 10
    assert estimated_tokens(_req(prompt="abcd", n=2, best_of=3)) == 1 + 30
    messages = ({"role": "system", "content": "a" * 8},
                {"role": "user", "content": [{"type": "text", "text": "b" * 4}, {"type": "image_url"}]},
                {"role": "assistant", "content": None, "tool_calls": []})
    assert estimated_tokens(_req(messages=messages)) == 3 + 10


def test_a_prompt_array_counts_every_prompt():
    assert estimated_tokens(_req(prompt="abcd"), ("abcd", (1, 2), "abcdefgh")) == (1 + 2 + 2) + 3 * 10


async def test_closing_the_outer_of_two_body_ends_ends_both():
    ended: list[str] = []

    async def body() -> AsyncIterator[bytes]:
        yield b"data: one\n\n"
        yield b"data: two\n\n"

    inner = BodyEnd(body(), lambda: ended.append("slot"))
    outer = BodyEnd(inner, lambda: ended.append("metrics"))
    assert await outer.__anext__() == b"data: one\n\n"
    await outer.close()  # Falcon's close after a client left mid-stream
    assert ended == ["slot", "metrics"]
