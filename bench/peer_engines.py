"""Engine against engine, no HTTP: our LLMEngine and vLLM's offline `LLM`, alternated.

`make bench-peer` measures served stacks: the engine's step, the serving path (our gateway and Triton, vLLM's API
server) and the openai-SDK client all share the box's two cores, so a served ratio cannot say which of them a
difference comes from. This takes the serving path and the client out: each engine, in a process of its own,
generates for B = 1, 8 and 16 prompts submitted at once (the 8 prompts of bench/peer_workload.py as plain text,
repeated for 16), exactly 64 new tokens each (greedy, EOS ignored), with prefix caching on as both serve. A
figure is tok/s = new tokens / wall time from submission to the last token, median of 3 after one warm-up.

Runs alternate (ours, vLLM, ours, vLLM), one process at a time, a CPU probe (bench/cpu_probe.py) before and
after each; a dtype is flagged `noisy` on the same rules as `make bench-peer` (bench/peer_stats.py). Prints both
sides' figures and peer_engine_ratio_b1/b8/b16_<dtype> (ours over vLLM's). About 5 minutes a dtype.

    make bench-peer-engines            # fp32; PEER_ENGINE_ARGS="--dtypes float32,bfloat16" for both
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from bench.cpu_probe import probe_gflops
from bench.peer_runs import MODEL_DIR, VLLM_VENV, vllm_env
from bench.peer_stats import alternation, median_figures, noise_reasons
from bench.peer_workload import PROMPTS
from devstack.triton import REPO_ROOT

BATCHES = (1, 8, 16)
NEW_TOKENS = 64
REPS = 3
FIGURES = tuple(f"tok_s_b{b}" for b in BATCHES)
DTYPES = {"float32": "fp32", "bfloat16": "bf16"}

# vLLM's side, run by its own venv's python: spawned engine processes need the __main__ guard
_VLLM_SCRIPT = """
import json, statistics, sys, time
from vllm import LLM, SamplingParams

def main():
    model, dtype, prompts, batches, new_tokens, reps = json.loads(sys.argv[1])
    llm = LLM(model=model, dtype=dtype)
    params = SamplingParams(temperature=0.0, max_tokens=new_tokens, min_tokens=new_tokens, ignore_eos=True)
    figures = {}
    for b in batches:
        batch = (prompts * 2)[:b]
        walls = []
        for _ in range(reps + 1):  # the first is a warm-up
            t0 = time.perf_counter()
            outs = llm.generate(batch, params, use_tqdm=False)
            walls.append(time.perf_counter() - t0)
        tokens = sum(len(o.outputs[0].token_ids) for o in outs)
        if tokens != new_tokens * b:
            raise RuntimeError(f"B={b}: {tokens} new tokens, expected {new_tokens * b}")
        figures[f"tok_s_b{b}"] = tokens / statistics.median(walls[1:])
    print("RESULT " + json.dumps(figures), flush=True)

if __name__ == "__main__":
    main()
"""


def measure_engine(engine, batches=BATCHES, new_tokens: int = NEW_TOKENS, reps: int = REPS) -> dict[str, float]:
    """tok/s of a started LLMEngine at each batch: the same prompts, parameters and timing as vLLM's side."""
    from bench.engine import Collector  # torch: only in the measuring process
    from engine.sampling_params import SamplingParams

    ids = [engine.tokenizer(p)["input_ids"] for p in PROMPTS]
    params = SamplingParams(temperature=0.0, max_tokens=new_tokens, min_tokens=new_tokens, ignore_eos=True)
    figures, submitted = {}, 0
    for b in batches:
        walls = []
        for _ in range(reps + 1):  # the first is a warm-up
            t0 = time.perf_counter()
            requests = []
            for prompt in (ids * 2)[:b]:
                submitted += 1
                requests.append(Collector(engine.generate(f"peer-{submitted}", prompt, params), t0))
            tokens = sum(request.wait().tokens() for request in requests)  # wait() raises on an error
            walls.append(time.perf_counter() - t0)
            if tokens != new_tokens * b:
                raise RuntimeError(f"B={b}: {tokens} new tokens, expected {new_tokens * b}")
        figures[f"tok_s_b{b}"] = new_tokens * b / statistics.median(walls[1:])
    return figures


def measure_ours(dtype: str) -> dict[str, float]:
    from engine.llm_engine import EngineConfig, LLMEngine

    engine = LLMEngine(EngineConfig(str(MODEL_DIR), max_slots=32, max_len=2048, dtype=dtype))
    engine.start()
    try:
        return measure_engine(engine)
    finally:
        engine.stop()


def _run_side(side: str, dtype: str, log: Path) -> dict[str, float]:
    if side == "ours":
        cmd = [sys.executable, "-m", "bench.peer_engines", "--measure-ours", dtype]
        env = dict(os.environ)
    else:
        script = log.with_suffix(".py")
        script.write_text(_VLLM_SCRIPT)
        args = [str(MODEL_DIR), dtype, PROMPTS, list(BATCHES), NEW_TOKENS, REPS]
        cmd, env = [str(VLLM_VENV / "bin" / "python"), str(script), json.dumps(args)], vllm_env(log.parent)
    with open(log, "w") as out:
        subprocess.run(cmd, cwd=REPO_ROOT, env=env, stdout=out, stderr=subprocess.STDOUT, timeout=1800, check=True)
    for line in log.read_text().splitlines():
        if line.startswith("RESULT "):
            return json.loads(line[len("RESULT "):])
    raise RuntimeError(f"{side}: no RESULT line in {log}")


def run_dtype(dtype: str, runs_each: int, log_root: Path) -> dict:
    short = DTYPES[dtype]
    runs, probes = [], []
    for n, side in enumerate(alternation(runs_each)):
        probes.append(probe_gflops())
        figures = _run_side(side, dtype, log_root / f"{short}-{n}-{side}.log")
        probes.append(probe_gflops())
        print(f"[{short} {side}] " + "  ".join(f"{k} {v:.1f}" for k, v in figures.items())
              + f"  probe {probes[-2]:.1f} -> {probes[-1]:.1f} GFLOP/s", flush=True)
        runs.append({"side": side, "figures": figures})
    by_side = {side: [r["figures"] for r in runs if r["side"] == side] for side in ("ours", "vllm")}
    medians = {side: median_figures(side_runs) for side, side_runs in by_side.items()}
    reasons = noise_reasons(probes, by_side, headline=FIGURES)
    ratios = {f"peer_engine_ratio_b{b}": medians["ours"][f"tok_s_b{b}"] / medians["vllm"][f"tok_s_b{b}"]
              for b in BATCHES}
    return {"dtype": dtype, "runs": runs, "probes": probes, "medians": medians, "ratios": ratios,
            "noisy_reasons": reasons}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--dtypes", default="float32", help="comma-separated, of: " + ", ".join(DTYPES))
    parser.add_argument("--runs", type=int, default=2, help="runs of each engine per dtype, alternated")
    parser.add_argument("--measure-ours", metavar="DTYPE", help=argparse.SUPPRESS)  # the child process
    opts = parser.parse_args()
    if opts.measure_ours:
        print("RESULT " + json.dumps(measure_ours(opts.measure_ours)), flush=True)
        return
    dtypes = [d.strip() for d in opts.dtypes.split(",") if d.strip()]
    if not dtypes or any(d not in DTYPES for d in dtypes):
        parser.error(f"--dtypes: choose from {', '.join(DTYPES)}")
    if not (VLLM_VENV / "bin" / "python").exists():
        sys.exit(f"no vLLM venv at {VLLM_VENV}: run bench/install_vllm_peer.sh first")
    log_root = Path(tempfile.mkdtemp(prefix="bench-peer-engines-"))
    print(f"logs: {log_root}", flush=True)
    results = {}
    for dtype in dtypes:
        result = results[DTYPES[dtype]] = run_dtype(dtype, opts.runs, log_root)
        short, mark = DTYPES[dtype], "  noisy" if result["noisy_reasons"] else ""
        for side, f in result["medians"].items():
            print(f"{side} engine, {short}: " + "  ".join(f"{k} {v:.1f}" for k, v in f.items()))
        for reason in result["noisy_reasons"]:
            print(f"  noisy: {reason}")
        for key, value in result["ratios"].items():
            print(f"{key}_{short}: {value:.3f}{mark}", flush=True)
    out = REPO_ROOT / "bench" / "results" / "peer_engines.json"
    out.write_text(json.dumps(results, indent=2))
    print(f"results: {out}")


if __name__ == "__main__":
    main()
