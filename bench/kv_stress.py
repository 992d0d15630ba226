"""A stress run of the scheduler on the served stack: a small KV pool, the prefix cache on, and clients that leave.

SmolLM2 served with `kv_budget_tokens` 2048 (the pool holds about 8 of these chats at once) and the prefix cache in
all of it, with `debug_scheduler_invariants` on, so a broken invariant fails the engine instead of losing a request
quietly. A few hundred streamed chats share a handful of long system prompts, two dozen at a time, with mixed
`max_tokens`; about one client in eight leaves after a few chunks. Greedy, so an answer that ran to its end can be
compared with the same chat sent alone afterwards (preempted and recomputed, or not, the text must be the same).

Printed: requests served, errors, client departures, preemptions; mismatches against the answers alone; and, once
the load has ended, the engine's running and waiting requests and its KV use, which must all be back at 0 (nothing
lost, no block leaked). Exits non-zero when any of these fails. Runs alone on the box (a few minutes):
`.venv/bin/python -m bench.kv_stress`.
"""

from __future__ import annotations

import argparse
import asyncio
import random
import sys
import tempfile
import time
from pathlib import Path

from openai import AsyncOpenAI

from bench.chatload import metric_sum
from bench.chatload_workload import SERVED, WORDS
from bench.peer_runs import repository_in_dtype, with_parameter
from devstack.stack import local_stack

SYSTEM_PROMPTS = [f"You are assistant {i} of a support team. Background for every answer: "
                  + " ".join(WORDS[(i * 17 + j) % len(WORDS)] for j in range(200)) for i in range(4)]
QUESTIONS = ["What should I check first?", "Summarise the background.", "Name two risks.", "Give one example.",
             "What changed?", "Who reads the logs?"]
MAX_TOKENS = [8, 32, 96, 200]
ENGINE_GAUGES = ("sie_engine_num_requests_running", "sie_engine_num_requests_waiting", "sie_engine_kv_cache_usage_perc")


def chat(index: int) -> tuple[list[dict], int, bool]:
    """The messages, max_tokens and whether the client leaves early, for chat `index`."""
    rng = random.Random(index)
    messages = [{"role": "system", "content": SYSTEM_PROMPTS[rng.randrange(len(SYSTEM_PROMPTS))]},
                {"role": "user", "content": f"{rng.choice(QUESTIONS)} (ticket {index})"}]
    return messages, rng.choice(MAX_TOKENS), rng.random() < 1 / 8


async def one_chat(client: AsyncOpenAI, messages: list[dict], max_tokens: int, leave_after: int | None) -> str:
    """The streamed answer; a client that leaves closes its stream after `leave_after` content chunks."""
    parts: list[str] = []
    stream = await client.chat.completions.create(model=SERVED, messages=messages, max_tokens=max_tokens,
                                                  temperature=0, stream=True)
    async with stream:
        async for chunk in stream:
            for choice in chunk.choices:
                if choice.delta.content:
                    parts.append(choice.delta.content)
            if leave_after is not None and len(parts) >= leave_after:
                break
    return "".join(parts)


async def load(base_url: str, chats: int, concurrency: int) -> tuple[dict[int, str], list[str], int]:
    """Every chat through `concurrency` clients at a time. Returns the answers that ran to their end, the errors,
    and how many clients left early."""
    answers: dict[int, str] = {}
    errors: list[str] = []
    left = 0
    gate = asyncio.Semaphore(concurrency)

    async def client_for(index: int, client: AsyncOpenAI) -> None:
        nonlocal left
        messages, max_tokens, leaves = chat(index)
        async with gate:
            try:
                text = await one_chat(client, messages, max_tokens, 3 if leaves else None)
            except Exception as exc:  # counted: the stress run's verdict
                errors.append(f"chat {index}: {type(exc).__name__}: {str(exc)[:200]}")
                return
        if leaves:
            left += 1
        else:
            answers[index] = text

    async with AsyncOpenAI(base_url=f"{base_url}/v1", api_key="stress", timeout=600, max_retries=0) as client:
        await asyncio.gather(*(client_for(i, client) for i in range(chats)))
    return answers, errors, left


async def alone(base_url: str, indices: list[int]) -> dict[int, str]:
    async with AsyncOpenAI(base_url=f"{base_url}/v1", api_key="stress", timeout=600, max_retries=0) as client:
        out = {}
        for index in indices:
            messages, max_tokens, _ = chat(index)
            out[index] = await one_chat(client, messages, max_tokens, None)
        return out


def settled(metrics_url: str, timeout_s: float = 30.0) -> dict[str, float]:
    """The engine's gauges once they read 0 (or as they read after `timeout_s`)."""
    deadline = time.monotonic() + timeout_s
    while True:
        values = {name: metric_sum(metrics_url, name) for name in ENGINE_GAUGES}
        if all(value == 0 for value in values.values()) or time.monotonic() > deadline:
            return values
        time.sleep(1.0)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--chats", type=int, default=320)
    parser.add_argument("--concurrency", type=int, default=24)
    parser.add_argument("--kv-tokens", type=int, default=2048)
    parser.add_argument("--check-alone", type=int, default=24, help="answers compared with the same chat alone")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="kv-stress-") as tmp:
        repo = repository_in_dtype(Path(tmp), "float32")
        config = repo / "smollm2_135m_instruct" / "config.pbtxt"
        text = config.read_text()
        for key, value in (("kv_budget_tokens", args.kv_tokens), ("prefix_cache_tokens", args.kv_tokens),
                           ("max_slots", args.concurrency), ("debug_scheduler_invariants", "true")):
            text = with_parameter(text, key, str(value))
        config.write_text(text)
        with local_stack(repo, Path(tmp)) as stack:
            metrics = f"http://127.0.0.1:{stack.triton_ports.metrics}/metrics"
            t0 = time.monotonic()
            answers, errors, left = asyncio.run(load(stack.base_url, args.chats, args.concurrency))
            wall = time.monotonic() - t0
            gauges = settled(metrics)
            preemptions = metric_sum(metrics, "sie_engine_num_preemptions_total")
            sample = sorted(answers)[: args.check_alone]
            mismatches = [i for i, text in asyncio.run(alone(stack.base_url, sample)).items() if text != answers[i]]
    print(f"kv_stress_chats {args.chats} served {len(answers) + left} (ran to the end {len(answers)}, "
          f"left early {left}) in {wall:.0f} s")
    print(f"kv_stress_errors {len(errors)}")
    for error in errors[:10]:
        print(f"  {error}")
    print(f"kv_stress_preemptions {preemptions:g}")
    print(f"kv_stress_alone_mismatches {len(mismatches)} of {len(sample)} {mismatches}")
    print("kv_stress_after " + " ".join(f"{name.removeprefix('sie_engine_')} {value:g}"
                                        for name, value in gauges.items()))
    failed = errors or mismatches or any(value != 0 for value in gauges.values())
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
