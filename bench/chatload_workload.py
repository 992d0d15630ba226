"""The client side of `make bench-load`: the chat load a platform team brings, the same bytes to every server.

64 users start within a few seconds of each other; each has a two-turn conversation. A user's first prompt holds
40-320 tokens (a question with some context), the second turn carries the first question and answer and asks a
follow-up. Every request is streamed with `max_tokens` 1024 (what clients send) at temperature 0, and ends where
the model ends it. Per request: ok or the error, TTFT (to the first content delta) and completion tokens.
"""

from __future__ import annotations

import asyncio
import os
import random
import statistics
import time
from dataclasses import dataclass, field

from openai import AsyncOpenAI

SERVED = "HuggingFaceTB/SmolLM2-135M-Instruct"

TEXT = ("the team keeps a short list of services that answer requests from users across several regions and "
         "each service writes its logs to a shared store where an engineer reads them every morning before the "
         "daily meeting starts so that anything slow or broken is known early and fixed before customers notice "
         "it while the release notes describe which features changed and why a setting moved")
WORDS = TEXT.split()
QUESTIONS = ["What should the team check first?", "Summarise this in a few sentences.",
             "What could go wrong here, and how would you notice?", "Suggest two improvements.",
             "Explain this to a new engineer.", "Which part matters most, and why?"]
FOLLOW_UPS = ["Can you say that more briefly?", "Give one concrete example.", "What would you do next?"]


@dataclass(frozen=True)
class ChatLoad:
    users: int = 64
    turns: int = 2
    min_prompt_tokens: int = 40
    max_prompt_tokens: int = 320
    max_tokens: int = 1024
    start_spread_s: float = 2.0  # users arrive over this window
    seed: int = 0


@dataclass
class Result:
    ok: int = 0
    errors: list[str] = field(default_factory=list)
    ttfts: list[float] = field(default_factory=list)
    ttfts_by_turn: dict[int, list[float]] = field(default_factory=dict)
    completion_tokens: int = 0
    answers: dict[tuple[int, int], str] = field(default_factory=dict)  # (user, turn) -> answer text


def first_prompt(rng: random.Random, load: ChatLoad) -> str:
    """A question after a context of about the drawn number of tokens (a word of this text is ~1.25 tokens)."""
    tokens = rng.randint(load.min_prompt_tokens, load.max_prompt_tokens)
    words = max(8, int((tokens - 20) / 1.25))
    start = rng.randrange(len(WORDS))
    context = " ".join(WORDS[(start + i) % len(WORDS)] for i in range(words))
    return f"Context: {context}.\n\n{rng.choice(QUESTIONS)}"


async def stream_turn(client: AsyncOpenAI, messages: list[dict], load: ChatLoad) -> tuple[float, int, str]:
    t0 = time.perf_counter()
    ttft, tokens, parts = None, 0, []
    stream = await client.chat.completions.create(
        model=SERVED, messages=messages, max_tokens=load.max_tokens, temperature=0, stream=True,
        stream_options={"include_usage": True})
    async for chunk in stream:
        if chunk.usage is not None:
            tokens = chunk.usage.completion_tokens
        for choice in chunk.choices:
            if choice.delta.content:
                parts.append(choice.delta.content)
                if ttft is None:
                    ttft = time.perf_counter() - t0
    return (ttft if ttft is not None else time.perf_counter() - t0), tokens, "".join(parts)


async def _user(client: AsyncOpenAI, user: int, load: ChatLoad, result: Result) -> None:
    rng = random.Random(load.seed * 1000 + user)
    await asyncio.sleep(rng.uniform(0, load.start_spread_s))
    messages = [{"role": "user", "content": first_prompt(rng, load)}]
    for turn in range(load.turns):
        try:
            ttft, tokens, answer = await stream_turn(client, messages, load)
        except Exception as exc:  # a failed request is counted, and the user's conversation ends there
            code = getattr(exc, "code", None) or type(exc).__name__
            result.errors.append(f"user {user} turn {turn}: {code}: {str(exc)[:200]}")
            return
        result.ok += 1
        result.ttfts.append(ttft)
        result.ttfts_by_turn.setdefault(turn, []).append(ttft)
        result.completion_tokens += tokens
        result.answers[(user, turn)] = answer
        messages += [{"role": "assistant", "content": answer}, {"role": "user", "content": rng.choice(FOLLOW_UPS)}]


async def _run(base_url: str, load: ChatLoad) -> tuple[Result, float]:
    result = Result()
    async with AsyncOpenAI(base_url=f"{base_url}/v1", api_key=os.environ.get("SIE_API_KEY", "bench"),
                           timeout=900, max_retries=0) as client:
        await stream_turn(client, [{"role": "user", "content": "Hello"}], ChatLoad(max_tokens=4))  # warm-up
        t0 = time.perf_counter()
        await asyncio.gather(*(_user(client, u, load, result) for u in range(load.users)))
        return result, time.perf_counter() - t0


def quantile(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def measure(base_url: str, load: ChatLoad) -> dict:
    """The chat load against one server: requests ok and failed, tok/s, TTFT p50/p90, and each answer."""
    result, wall = asyncio.run(_run(base_url, load))
    figures = {"requests": load.users * load.turns, "ok": result.ok, "errors": len(result.errors),
               "tok_s": result.completion_tokens / wall, "wall_s": wall,
               "ttft_p50": statistics.median(result.ttfts) if result.ttfts else float("nan"),
               "ttft_p90": quantile(result.ttfts, 0.9), "completion_tokens": result.completion_tokens}
    for turn, ttfts in sorted(result.ttfts_by_turn.items()):  # first turns meet the arrival burst, later ones a full KV
        figures[f"ttft_p50_turn{turn + 1}"] = statistics.median(ttfts)
    for line in result.errors[:5]:
        print(f"  error: {line}", flush=True)
    return {"figures": figures, "answers": {f"{u}:{t}": a for (u, t), a in result.answers.items()}}
