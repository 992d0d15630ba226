"""What routing by the engines' KV events buys: multi-turn chats over two Tritons behind one gateway.

`python -m bench.prefix_routing` starts two tritonservers, each serving SmolLM2 alone with its KV events published
(the profile's kv_events_endpoint and kv_events_replay_endpoint), then the gateway twice over the same two: once
routing by load alone, once with each endpoint's `kv_events` in its routing entry (gateway/prefix_routing.py). Each
run plays `--users` chats of `--turns` turns, `--concurrency` at a time, none with a routing key: every user has a
long system prompt of its own, and each turn resends the conversation so far, as chat clients do. The conversations
differ between runs, so neither finds the other's blocks. Printed per run: the later turns' TTFT (p50, mean), the
share of their prompt found cached (`usage.prompt_tokens_details.cached_tokens`), and the first turns' TTFT.
Run it alone on the box.
"""

from __future__ import annotations

import argparse
import asyncio
import random
import statistics
import time
from pathlib import Path

import httpx
import orjson

from bench.peer_runs import repository_in_dtype, with_parameter
from devstack.net import free_port, wait_http
from devstack.serve import start_gateway, stop
from devstack.triton import TritonPorts, start_triton, wait_ready

SERVED = "HuggingFaceTB/SmolLM2-135M-Instruct"
WORDS = ("river", "stone", "lantern", "harbor", "meadow", "circuit", "violet", "anchor", "ember", "orchard",
         "canyon", "signal", "willow", "copper", "falcon", "glacier", "thistle", "beacon", "marble", "prism")


def _repository(dest: Path, events_port: int, replay_port: int) -> Path:
    repo = repository_in_dtype(dest, "float32")
    config = repo / "smollm2_135m_instruct" / "config.pbtxt"
    text = with_parameter(config.read_text(), "kv_events_endpoint", f"tcp://127.0.0.1:{events_port}")
    config.write_text(with_parameter(text, "kv_events_replay_endpoint", f"tcp://127.0.0.1:{replay_port}"))
    return repo


def _system_prompt(rng: random.Random, words: int) -> str:
    return "You are a helpful assistant. Background notes: " + " ".join(rng.choice(WORDS) for _ in range(words))


async def _turn(client: httpx.AsyncClient, url: str, messages: list[dict], max_tokens: int) -> tuple[float, str, int,
                                                                                                        int]:
    """(TTFT s, answer, prompt tokens, cached tokens) of one streamed chat turn."""
    started, first, text = time.monotonic(), None, []
    usage: dict = {}
    body = {"model": SERVED, "messages": messages, "max_tokens": max_tokens, "temperature": 0, "stream": True,
            "stream_options": {"include_usage": True}}
    async with client.stream("POST", url + "/v1/chat/completions", json=body) as response:
        response.raise_for_status()
        async for line in response.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = orjson.loads(line[6:])
            for choice in chunk.get("choices") or ():
                if choice["delta"].get("content"):
                    first = first or time.monotonic()
                    text.append(choice["delta"]["content"])
            usage = chunk.get("usage") or usage
    cached = (usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0
    return (first or time.monotonic()) - started, "".join(text), usage.get("prompt_tokens", 0), cached


async def _play(url: str, seed: int, args: argparse.Namespace) -> dict[str, float]:
    first_ttft: list[float] = []
    later_ttft: list[float] = []
    later_prompt = later_cached = 0
    gate = asyncio.Semaphore(args.concurrency)

    async def user(number: int) -> None:
        nonlocal later_prompt, later_cached
        rng = random.Random(seed * 10_000 + number)
        messages = [{"role": "system", "content": _system_prompt(rng, args.system_words)}]
        async with httpx.AsyncClient(timeout=300) as client:
            for turn in range(args.turns):
                messages.append({"role": "user", "content": f"Question {turn + 1}: what does "
                                 f"'{rng.choice(WORDS)}' bring to mind? Answer briefly."})
                async with gate:
                    ttft, answer, prompt, cached = await _turn(client, url, messages, args.max_tokens)
                messages.append({"role": "assistant", "content": answer})
                if turn == 0:
                    first_ttft.append(ttft)
                else:
                    later_ttft.append(ttft)
                    later_prompt += prompt
                    later_cached += cached

    await asyncio.gather(*(user(n) for n in range(args.users)))
    return {"later_ttft_p50_ms": statistics.median(later_ttft) * 1000,
            "later_ttft_mean_ms": statistics.fmean(later_ttft) * 1000,
            "later_cached_share": later_cached / max(later_prompt, 1),
            "first_ttft_p50_ms": statistics.median(first_ttft) * 1000}


def _gateway_config(path: Path, nodes: list[tuple[TritonPorts, int, int]], with_events: bool) -> Path:
    lines = ["pools:", "  default:", "    endpoints:"]
    for number, (ports, events, replay) in enumerate(nodes):
        lines += [f"      - url: 127.0.0.1:{ports.grpc}", f"        name: triton-{number}"]
        if with_events:
            lines += ["        kv_events:", f"          - events: tcp://127.0.0.1:{events}",
                      f"            replay: tcp://127.0.0.1:{replay}"]
    path.write_text("\n".join(lines) + "\n")
    return path


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--users", type=int, default=24)
    parser.add_argument("--turns", type=int, default=3)
    parser.add_argument("--concurrency", type=int, default=4)
    parser.add_argument("--system-words", type=int, default=250, help="each user's own system prompt, in words")
    parser.add_argument("--max-tokens", type=int, default=24)
    parser.add_argument("--log-dir", type=Path, default=Path("build/bench-prefix-routing"))
    args = parser.parse_args()
    args.log_dir.mkdir(parents=True, exist_ok=True)
    nodes, procs = [], []
    try:
        for number in range(2):
            ports, events, replay = TritonPorts(free_port(), free_port(), free_port()), free_port(), free_port()
            repo = _repository(args.log_dir / f"triton-{number}", events, replay)
            procs.append(start_triton(repo, ports, args.log_dir / f"triton-{number}.log"))
            nodes.append((ports, events, replay))
        for (ports, _, _), proc in zip(nodes, procs, strict=True):
            wait_ready(ports, proc, timeout=600)
        for seed, with_events in enumerate((False, True)):
            port = free_port()
            config = _gateway_config(args.log_dir / f"gateway-{with_events}.yaml", nodes, with_events)
            gateway = start_gateway(nodes[0][0].grpc, port, workers=1, log_path=args.log_dir / "gateway.log",
                                    extra_env={"SIE_AUTH_MODE": "none", "SIE_GATEWAY_CONFIG": str(config)})
            try:
                url = f"http://127.0.0.1:{port}"
                wait_http(url + "/readyz", timeout=120)
                time.sleep(3)  # both endpoints discovered, the event feeds connected
                figures = asyncio.run(_play(url, seed, args))
            finally:
                stop(gateway)
            label = "load + KV events" if with_events else "load alone"
            print(f"{label:>16}: " + ", ".join(f"{k} {v:.3f}" if "share" in k else f"{k} {v:.0f}"
                                               for k, v in figures.items()), flush=True)
    finally:
        for proc in procs:
            stop(proc)


if __name__ == "__main__":
    main()
