"""The chat load at equal KV memory: our stack, then vLLM's CPU build, one server at a time (`make bench-load`).

The load is bench/chatload_workload.py (64 users x 2 turns, prompts of 40-320 tokens, `max_tokens` 1024, greedy,
natural ends). Both servers get the same KV memory, `--kv-gib` (1 GiB by default):
- vLLM: `VLLM_CPU_KVCACHE_SPACE`, which holds its prefix cache too;
- ours: that many bytes of K/V positions for SmolLM2 in the served dtype as `kv_budget_tokens`, the prefix cache
  living in what the running requests leave of it (docs/kv-memory.md) up to `prefix_cache_tokens`
  (`--prefix-tokens`; by default all of it, as any free vLLM block may hold a cached prefix), set in a temporary
  copy of the model repository (the checked-in profile is never edited).

After the load, `--check-alone` first turns are sent again one at a time: a greedy answer under load must equal
the same prompt alone (preemption and recompute included). Printed: each side's figures, then chatload_errors
(ours), chatload_tps_ratio (our tok/s over vLLM's), chatload_ttft_p50_ratio (our TTFT p50 over vLLM's) and
chatload_alone_mismatches. Results: bench/results/chatload.json. Nothing else may run on the box meanwhile.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import tempfile
import threading
import time
from pathlib import Path

import httpx
from openai import AsyncOpenAI

from bench import peer_runs
from bench.chatload_workload import ChatLoad, first_prompt, measure, stream_turn
from bench.peer_runs import MODEL_DIR, VLLM_VENV, repository_in_dtype, with_parameter
from bench.peer_workload import FULL
from devstack.stack import local_stack
from devstack.triton import REPO_ROOT

RESULTS = REPO_ROOT / "bench" / "results" / "chatload.json"


def kv_bytes_per_token(dtype: str, kv_cache_dtype: str = "auto") -> int:
    """K/V bytes a position: the activations' dtype under `auto`, else `kv_cache_dtype`'s (int8: a byte a value and a
    4-byte scale a KV head, engine.model.kv_cache)."""
    config = json.loads((MODEL_DIR / "config.json").read_text())
    heads = config.get("num_key_value_heads", config["num_attention_heads"])
    head_dim = config.get("head_dim", config["hidden_size"] // config["num_attention_heads"])
    if kv_cache_dtype == "int8":
        return 2 * config["num_hidden_layers"] * heads * (head_dim + 4)
    wide = dtype == "float32" and kv_cache_dtype == "auto"
    return 2 * config["num_hidden_layers"] * heads * head_dim * (4 if wide else 2)


def our_repository(dest: Path, dtype: str, kv_gib: float, prefix_tokens: int | None, users: int,
                   overrides: dict[str, str] | None = None) -> tuple[Path, int]:
    """SmolLM2's folder with the KV memory as the module says, the model's own context (vLLM serves its
    max_position_embeddings, so a second turn of 1.2k tokens plus max_tokens 1024 is no 400 on either side), and a
    slot for every user."""
    repo = repository_in_dtype(dest, dtype)
    budget = int(kv_gib * 2**30) // kv_bytes_per_token(dtype, (overrides or {}).get("kv_cache_dtype", "auto"))
    prefix_tokens = budget if prefix_tokens is None else prefix_tokens
    context = json.loads((MODEL_DIR / "config.json").read_text())["max_position_embeddings"]
    config = repo / "smollm2_135m_instruct" / "config.pbtxt"
    text = config.read_text()
    for key, value in (("kv_budget_tokens", budget), ("prefix_cache_tokens", prefix_tokens),
                       ("context_length", context), ("max_output_tokens", context), ("max_slots", users),
                       *(overrides or {}).items()):
        text = with_parameter(text, key, str(value))
    config.write_text(text)
    return repo, budget


def metric_sum(url: str, name: str) -> float:
    """The sum of a metric's series on a Prometheus page (-1 when it cannot be read)."""
    try:
        body = httpx.get(url, timeout=10).text
    except httpx.HTTPError:
        return -1.0
    return sum(float(line.rsplit(" ", 1)[1]) for line in body.splitlines()
               if line.startswith(name + "{") or line.startswith(name + " "))


def timeline(url: str, stop: threading.Event, every_s: float = 15.0) -> None:
    """Our engine's queue, running requests, KV use, preemptions and tokens every `every_s` during the load."""
    names = {"sie_engine_num_requests_waiting": "waiting", "sie_engine_num_requests_running": "running",
             "sie_engine_kv_cache_usage_perc": "kv", "sie_engine_num_preemptions_total": "preempted",
             "sie_engine_generation_tokens_total": "tokens"}
    t0 = time.monotonic()
    while not stop.wait(every_s):
        values = {label: metric_sum(url, name) for name, label in names.items()}
        print(f"  t={time.monotonic() - t0:4.0f}s " + " ".join(f"{k} {v:g}" for k, v in values.items()), flush=True)


def alone_mismatches(base_url: str, load: ChatLoad, answers: dict[str, str], sample: int) -> int:
    """First turns of `sample` users sent again one at a time; how many answers differ from the loaded run's."""
    async def run() -> int:
        wrong = 0
        async with AsyncOpenAI(base_url=f"{base_url}/v1", api_key="bench", timeout=900, max_retries=0) as client:
            for user in range(min(sample, load.users)):
                if f"{user}:0" not in answers:
                    continue
                rng = random.Random(load.seed * 1000 + user)
                rng.uniform(0, load.start_spread_s)  # the same draws as the loaded run
                _, _, alone = await stream_turn(client, [{"role": "user", "content": first_prompt(rng, load)}], load)
                if alone != answers[f"{user}:0"]:
                    wrong += 1
                    print(f"  user {user}: the answer alone differs from the one under load", flush=True)
        return wrong
    return asyncio.run(run())


def run_ours(args, load: ChatLoad, log_dir: Path) -> dict:
    overrides = dict(item.split("=", 1) for item in args.param)
    repo, budget = our_repository(log_dir, args.dtype, args.kv_gib, args.prefix_tokens, load.users, overrides)
    print(f"[ours] kv_budget_tokens {budget}, prefix_cache_tokens {args.prefix_tokens or budget}", flush=True)
    with local_stack(repo, log_dir) as stack:
        url = f"http://127.0.0.1:{stack.triton_ports.metrics}/metrics"
        stop = threading.Event()
        watcher = threading.Thread(target=timeline, args=(url, stop), daemon=True)
        watcher.start()
        out = measure(stack.base_url, load)
        stop.set()
        out["figures"]["preemptions"] = metric_sum(f"http://127.0.0.1:{stack.triton_ports.metrics}/metrics",
                                                    "sie_engine_num_preemptions_total")
        if args.check_alone:
            out["figures"]["alone_mismatches"] = alone_mismatches(stack.base_url, load, out["answers"],
                                                                  args.check_alone)
    return out


def run_vllm(args, load: ChatLoad, log_dir: Path) -> dict:
    def at(url: str) -> dict:
        out = measure(url, load)
        out["figures"]["preemptions"] = metric_sum(f"{url}/metrics", "vllm:num_preemptions_total")
        if args.check_alone:
            out["figures"]["alone_mismatches"] = alone_mismatches(url, load, out["answers"], args.check_alone)
        return out

    extra = ["--kv-cache-dtype", args.vllm_kv_cache_dtype] if args.vllm_kv_cache_dtype else []
    return peer_runs.run_vllm(args.dtype, log_dir, FULL, kv_space_gib=args.kv_gib, measure_at=at, extra_args=extra)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    parser.add_argument("--kv-gib", type=float, default=1.0)
    parser.add_argument("--prefix-tokens", type=int, default=None, help="the prefix cache's cap (default: the budget)")
    parser.add_argument("--users", type=int, default=64)
    parser.add_argument("--check-alone", type=int, default=8, help="first turns re-sent alone (0: none)")
    parser.add_argument("--skip-vllm", action="store_true")
    parser.add_argument("--vllm-kv-cache-dtype", help="vLLM's --kv-cache-dtype (fp8 beside our int8: "
                        "--param kv_cache_dtype=int8, which sizes our budget to the same memory)")
    parser.add_argument("--param", action="append", default=[], metavar="KEY=VALUE",
                        help="one more profile parameter for our side (an experiment; e.g. "
                             "max_num_batched_tokens=2048)")
    args = parser.parse_args()
    load = ChatLoad(users=args.users)
    results: dict[str, dict] = {}
    with tempfile.TemporaryDirectory(prefix="chatload-") as tmp:
        for side in ("ours", "vllm"):
            if side == "vllm" and (args.skip_vllm or not (VLLM_VENV / "bin" / "python").exists()):
                print("[vllm] skipped (not installed, or --skip-vllm)", flush=True)
                continue
            log_dir = Path(tmp) / side
            log_dir.mkdir()
            t0 = time.monotonic()
            out = (run_ours if side == "ours" else run_vllm)(args, load, log_dir)
            results[side] = out["figures"]
            print(f"[{side}] {json.dumps({k: round(v, 3) for k, v in out['figures'].items()})} "
                  f"({time.monotonic() - t0:.0f} s)", flush=True)
    ours = results["ours"]
    print(f"chatload_errors: {ours['errors']}")
    if "alone_mismatches" in ours:
        print(f"chatload_alone_mismatches: {ours['alone_mismatches']}")
    if "vllm" in results:
        peer = results["vllm"]
        print(f"chatload_vllm_errors: {peer['errors']}")
        print(f"chatload_tps_ratio: {ours['tok_s'] / peer['tok_s']:.3f}")
        print(f"chatload_ttft_p50_ratio: {ours['ttft_p50'] / peer['ttft_p50']:.3f}")
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    RESULTS.write_text(json.dumps({"load": vars(load), "args": vars(args), "results": results}, indent=1))


if __name__ == "__main__":
    main()
