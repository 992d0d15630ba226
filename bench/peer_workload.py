"""The client side of `make bench-peer` (bench/peer.py): one openai-SDK client drives one server, the same bytes
to ours and to vLLM.

- 8 chat prompts of about 35 tokens, exactly 64 new tokens each (greedy, `min_tokens`=64, streamed), at
  concurrency 1, 8 and 16 (16 requests: the 8 prompts twice); tok/s = completion tokens / wall time, TTFT = time
  to the first content delta; median over 3 rounds, after one warm-up round (`--quick`: 1 round, 16 tokens).
- a chat turn after a ~1,500-token history (a system prompt and 8 turns), `max_tokens` 8, streamed: "cold" runs
  change the first words of the system prompt so that no cache can help, "cached" runs repeat one history (sent
  once before, unmeasured) with a new last turn each time; median over the rounds.
"""

from __future__ import annotations

import asyncio
import os
import statistics
import time
from dataclasses import dataclass

from openai import AsyncOpenAI

SERVED = "HuggingFaceTB/SmolLM2-135M-Instruct"
CONCURRENCIES = (1, 8, 16)


@dataclass(frozen=True)
class Workload:
    rounds: int = 3  # measured rounds of each figure (the median is kept)
    new_tokens: int = 64  # exactly this many per throughput request


FULL = Workload()
QUICK = Workload(rounds=1, new_tokens=16)  # a smoke check of the plumbing: its figures prove nothing

PROMPTS = [
    "Explain in a few plain sentences why the sky looks blue during the day but red and orange at sunset.",
    "Give me three practical tips for keeping a small vegetable garden healthy through a hot and dry summer.",
    "Describe how a bicycle's gears make it easier to ride up a steep hill, as if to a curious ten year old.",
    "Write a short friendly note to a neighbour asking them to water my plants while I am away next week.",
    "What are the main differences between a lake and a sea? Answer briefly and mention at least two examples.",
    "Summarise the plot of a classic fairy tale of your choice in five sentences, keeping the ending happy.",
    "List a few simple ways to save electricity at home in winter without spending money on new appliances.",
    "Explain what a database index is and why it makes some queries faster, in terms a beginner understands.",
]


async def _stream_chat(client: AsyncOpenAI, messages: list[dict], max_tokens: int, min_tokens: int | None
                       ) -> tuple[float, int]:
    """One streamed chat request -> (TTFT s, completion tokens)."""
    extra = {"min_tokens": min_tokens} if min_tokens else {}
    t0 = time.perf_counter()
    ttft = None
    tokens = 0
    deltas = 0
    stream = await client.chat.completions.create(
        model=SERVED, messages=messages, max_tokens=max_tokens, temperature=0, stream=True,
        stream_options={"include_usage": True}, extra_body=extra)
    async for chunk in stream:
        if chunk.usage is not None:
            tokens = chunk.usage.completion_tokens
        for choice in chunk.choices:
            if choice.delta.content:
                deltas += 1
                if ttft is None:
                    ttft = time.perf_counter() - t0
    if ttft is None:
        raise RuntimeError("the stream carried no content")
    return ttft, tokens or deltas


async def _throughput_round(client: AsyncOpenAI, concurrency: int, new_tokens: int) -> tuple[float, float]:
    """(tok/s, TTFT p50) of one round at `concurrency`."""
    prompts = (PROMPTS * 2)[: max(len(PROMPTS), concurrency)]
    gate = asyncio.Semaphore(concurrency)

    async def one(prompt: str) -> tuple[float, int]:
        async with gate:
            return await _stream_chat(client, [{"role": "user", "content": prompt}], new_tokens, new_tokens)

    t0 = time.perf_counter()
    results = await asyncio.gather(*(one(p) for p in prompts))
    wall = time.perf_counter() - t0
    tokens = sum(r[1] for r in results)
    if tokens != new_tokens * len(prompts):
        print(f"  warning: {tokens} tokens, expected {new_tokens * len(prompts)}", flush=True)
    return tokens / wall, statistics.median(r[0] for r in results)


def _history(tag: str) -> list[dict]:
    """A system prompt and 8 turns, about 1,450 tokens rendered; `tag` leads so different tags share no block."""
    system = (f"[{tag}] You are a careful assistant for a small engineering team. Answer precisely and briefly, "
              "cite the earlier turns of this conversation when they matter, and say so when you are unsure.")
    topics = ["the build system", "the release checklist", "the database migration", "the load test results"]
    messages = [{"role": "system", "content": system}]
    for i, topic in enumerate(topics):
        detail = " ".join(f"Point {j}: the notes on {topic} say step {j} must be checked twice before anyone "
                          f"signs off, and the owner of step {j} writes down what was seen." for j in range(1, 7))
        messages.append({"role": "user", "content": f"Turn {i}. Here is what we know about {topic}. {detail}"})
        messages.append({"role": "assistant", "content": f"Understood. For {topic}, every step is checked twice "
                         f"and its owner records the result. {detail[: len(detail) // 2]}"})
    return messages


async def _history_ttfts(client: AsyncOpenAI, rounds: int) -> tuple[float, float]:
    """(cold TTFT median, cached TTFT median) of one more user turn after a ~1,500-token history."""
    cold, cached = [], []
    for i in range(rounds):
        msgs = _history(f"cold-{os.getpid()}-{time.time_ns()}-{i}")
        cold.append((await _stream_chat(client, [*msgs, {"role": "user", "content": "Summarise turn 2."}], 8,
                                        None))[0])
    shared = _history(f"shared-{os.getpid()}-{time.time_ns()}")
    await _stream_chat(client, [*shared, {"role": "user", "content": "Which topic came first?"}], 8, None)
    for i in range(rounds):
        turn = {"role": "user", "content": f"Question {i}: what does the owner of step {i + 1} do?"}
        cached.append((await _stream_chat(client, [*shared, turn], 8, None))[0])
    print(f"  history turn TTFT cold {[round(x, 3) for x in cold]}  cached {[round(x, 3) for x in cached]}",
          flush=True)
    return statistics.median(cold), statistics.median(cached)


async def _measure(base_url: str, workload: Workload) -> dict[str, float]:
    figures: dict[str, float] = {}
    async with AsyncOpenAI(base_url=f"{base_url}/v1", api_key=os.environ.get("SIE_API_KEY", "bench"),
                           timeout=600, max_retries=0) as client:
        # warm-up: first-request costs (compile, allocation) are not measured
        await _throughput_round(client, 8, workload.new_tokens)
        for c in CONCURRENCIES:
            results = [await _throughput_round(client, c, workload.new_tokens) for _ in range(workload.rounds)]
            figures[f"tok_s_c{c}"] = statistics.median(r[0] for r in results)
            figures[f"ttft_p50_c{c}"] = statistics.median(r[1] for r in results)
            print(f"  c{c}: {figures[f'tok_s_c{c}']:.1f} tok/s, TTFT p50 {figures[f'ttft_p50_c{c}']:.3f} s",
                  flush=True)
        figures["cold_ttft"], figures["cached_ttft"] = await _history_ttfts(client, workload.rounds)
    return figures


def measure(base_url: str, workload: Workload) -> dict[str, float]:
    """The whole workload against one server: tok_s_cN and ttft_p50_cN for each concurrency, cold_ttft and
    cached_ttft of the history turn (seconds)."""
    return asyncio.run(_measure(base_url, workload))
