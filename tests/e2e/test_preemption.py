"""Preemption on the real stack: SmolLM2 served with a KV budget far smaller than the load's answers, so running
requests are preempted and recomputed (docs/kv-memory.md). Every streamed answer equals the same request sent
alone, nothing is sent twice, and Triton's metrics count the preemptions."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from pathlib import Path

import pytest
from openai import AsyncOpenAI

from devstack.stack import LocalStack, local_stack
from tests.helpers.prometheus import metric_value, scrape
from tests.helpers.repository import smollm2_only

from .conftest import MODEL

BUDGET_TOKENS = 384  # 24 blocks: the prompts fit at once, their answers (about 36 blocks) do not
QUESTIONS = ["Why is the sky blue?", "Write a haiku about rain.", "Name three primary colors.",
             "How do bees make honey?", "What is a prime number?", "Describe a cat in two sentences."]
TOKENS = 48


@pytest.fixture(scope="module")
def small_kv_stack(tmp_path_factory) -> Iterator[LocalStack]:
    root = tmp_path_factory.mktemp("small-kv")
    # no prefix cache: every recompute runs the whole prompt and output again
    repo = smollm2_only(root, kv_budget_tokens=str(BUDGET_TOKENS), prefix_cache_tokens="0")
    with local_stack(repo, Path(root), extra_env={"SIE_AUTH_MODE": "none"}) as stack:
        yield stack


async def _chat(client: AsyncOpenAI, question: str) -> tuple[str, int]:
    """One streamed greedy chat: its text, and how many content deltas carried it."""
    stream = await client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": question}], max_tokens=TOKENS, temperature=0,
        stream=True, extra_body={"min_tokens": TOKENS})  # the full length: the load outgrows the budget
    parts = [c.choices[0].delta.content async for c in stream if c.choices and c.choices[0].delta.content]
    return "".join(parts), len(parts)


def _metric(stack: LocalStack, name: str) -> float:
    return metric_value(scrape(f"http://127.0.0.1:{stack.triton_ports.metrics}/metrics"), name)


def test_preempted_answers_equal_the_same_requests_alone(small_kv_stack):
    async def run() -> tuple[list[tuple[str, int]], list[tuple[str, int]]]:
        async with AsyncOpenAI(base_url=small_kv_stack.base_url + "/v1", api_key="none", timeout=600,
                               max_retries=0) as client:
            together = await asyncio.gather(*(_chat(client, q) for q in QUESTIONS))
            alone = [await _chat(client, q) for q in QUESTIONS]
        return together, alone

    together, alone = asyncio.run(run())
    assert _metric(small_kv_stack, "sie_engine_num_preemptions_total") > 0
    assert [text for text, _ in together] == [text for text, _ in alone]
    assert all(text and deltas <= TOKENS for text, deltas in together)
