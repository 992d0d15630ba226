"""The noisy neighbour: one tenant's flood of long requests beside another tenant's short chats, per scheduling policy.

SmolLM2 served with 128 batch rows and auth on, two keys of two tenants (team-a, team-b; team-b may ask for
priority -1). Tenant A keeps `--a-inflight` long requests in flight (`max_tokens` 512, natural ends); after a
warm-up, tenant B sends short streamed chats two at a time for `--window` seconds. Printed per run: B's TTFT p50 and
p90 and A's tok/s over the window. Each run starts its own stack (the policy is a profile key). Runs alone on the
box: `.venv/bin/python -m bench.noisy_neighbour --runs alone fcfs:64 fcfs:256 fair:256 priority:256`.

A run is `POLICY:A_INFLIGHT` (B at the default priority; `priority:N` sends B's chats at priority -1) or `alone`
(B only, fcfs).
"""

from __future__ import annotations

import argparse
import asyncio
import tempfile
import time
from pathlib import Path

from openai import APIStatusError, AsyncOpenAI

from bench.chatload_workload import QUESTIONS, SERVED, WORDS, quantile
from bench.peer_runs import repository_in_dtype, with_parameter
from devstack.stack import local_stack

KEY_A, KEY_B = "noisy-key-team-a-0123456789abcdef", "noisy-key-team-b-0123456789abcdef"
LONG_PROMPT = "Write a long, detailed report about this: " + " ".join(WORDS[:60])


async def tenant_a(base_url: str, inflight: int, stop: asyncio.Event, tokens: list[tuple[float, int]]) -> None:
    """Keeps `inflight` long requests going until `stop`; records (end time, completion tokens) of each."""
    async with AsyncOpenAI(base_url=f"{base_url}/v1", api_key=KEY_A, timeout=900, max_retries=0) as client:
        async def loop() -> None:
            while not stop.is_set():
                try:
                    out = await client.chat.completions.create(
                        model=SERVED, messages=[{"role": "user", "content": LONG_PROMPT}], max_tokens=512,
                        temperature=0.7)
                except Exception:  # a flood past the queue gets 503s: it just tries again
                    await asyncio.sleep(0.2)
                    continue
                tokens.append((time.monotonic(), out.usage.completion_tokens if out.usage else 0))

        tasks = [asyncio.create_task(loop()) for _ in range(inflight)]
        await stop.wait()
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


async def tenant_b(base_url: str, priority: int, until: float, ttfts: list[float], errors: list[str]) -> None:
    """Two clients sending short streamed chats back to back until `until`; records each TTFT, and each error's code
    (under fcfs a chat behind a flood that holds every row waits past the gateway's first-chunk timeout: a 504)."""
    async with AsyncOpenAI(base_url=f"{base_url}/v1", api_key=KEY_B, timeout=300, max_retries=0) as client:
        async def loop(worker: int) -> None:
            count = 0
            while time.monotonic() < until:
                count += 1
                t0 = time.perf_counter()
                first = None
                try:
                    stream = await client.chat.completions.create(
                        model=SERVED, messages=[{"role": "user", "content": f"{QUESTIONS[count % len(QUESTIONS)]} "
                                                 f"(chat {worker}-{count})"}],
                        max_tokens=16, temperature=0, stream=True, extra_body={"priority": priority})
                    async for chunk in stream:
                        if first is None and chunk.choices and chunk.choices[0].delta.content:
                            first = time.perf_counter() - t0
                except APIStatusError as exc:
                    errors.append(str(exc.status_code))
                if first is not None:
                    ttfts.append(first)

        await asyncio.gather(loop(0), loop(1))


async def measure(base_url: str, inflight: int, b_priority: int, warmup: float, window: float) -> dict[str, float]:
    stop = asyncio.Event()
    a_tokens: list[tuple[float, int]] = []
    flood = asyncio.create_task(tenant_a(base_url, inflight, stop, a_tokens)) if inflight else None
    await asyncio.sleep(warmup if inflight else 0)
    start = time.monotonic()
    ttfts: list[float] = []
    errors: list[str] = []
    await tenant_b(base_url, b_priority, start + window, ttfts, errors)
    end = time.monotonic()
    stop.set()
    if flood is not None:
        await flood
    served = sum(count for at, count in a_tokens if start <= at <= end)
    return {"b_ttft_p50": quantile(ttfts, 0.5), "b_ttft_p90": quantile(ttfts, 0.9), "b_chats": len(ttfts),
            "b_errors": ", ".join(errors) or "none", "a_tok_s": served / (end - start)}


def run(spec: str, warmup: float, window: float) -> dict[str, float]:
    policy, inflight = ("fcfs", 0) if spec == "alone" else (spec.split(":")[0], int(spec.split(":")[1]))
    with tempfile.TemporaryDirectory(prefix="noisy-") as tmp:
        repo = repository_in_dtype(Path(tmp), "float32")
        config = repo / "smollm2_135m_instruct" / "config.pbtxt"
        text = config.read_text()
        for key, value in (("max_slots", "128"), ("max_queue", "512"), ("scheduling_policy", policy),
                           ("max_num_batched_tokens", "1024")):
            text = with_parameter(text, key, value)
        config.write_text(text)
        keys = Path(tmp) / "keys"
        keys.write_text(f"team-a {KEY_A}\nteam-b {KEY_B} priority=-1..0\n")
        env = {"SIE_AUTH_MODE": "token", "SIE_AUTH_TOKENS_FILE": str(keys),
               "SIE_TENANT_SECRET_FILE": str(Path(tmp) / "tenant.secret")}
        with local_stack(repo, Path(tmp), extra_env=env) as stack:
            return asyncio.run(measure(stack.base_url, inflight, -1 if policy == "priority" else 0, warmup, window))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", nargs="+", default=["alone", "fcfs:64", "fcfs:256", "fair:256", "priority:256"])
    parser.add_argument("--warmup", type=float, default=15.0)
    parser.add_argument("--window", type=float, default=45.0)
    args = parser.parse_args()
    for spec in args.runs:
        figures = run(spec, args.warmup, args.window)
        print(f"noisy {spec}: B TTFT p50 {figures['b_ttft_p50']:.3f} s p90 {figures['b_ttft_p90']:.3f} s "
              f"({figures['b_chats']:g} chats, errors: {figures['b_errors']}), A {figures['a_tok_s']:.1f} tok/s",
              flush=True)


if __name__ == "__main__":
    main()
