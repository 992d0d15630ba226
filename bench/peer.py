"""vLLM's CPU build side by side with our stack: alternated runs, fp32 and bf16, one client.

For each dtype (fp32, then bf16), the two servers run alternately, each `--runs` times (default 2: ours, vLLM,
ours, vLLM), one at a time, on the same model folder: ours with the model profile's `dtype` parameter set in a
temporary copy of its repository (bench/peer_runs.py), vLLM with `--dtype`. Each run measures the workload of
bench/peer_workload.py: tok/s at c1/c8/c16, TTFT p50 at c8, and the TTFT of a turn after a ~1,500-token history,
cold and cached. `vllm bench serve` (vLLM's own client, unmodified) drives our `/v1/completions` once, in our
first run, after the measured part.

A fixed CPU probe (bench/cpu_probe.py: best-of-5 fp32 2048x2048 GEMM) is timed before each server starts and
after it stops. A dtype's runs are flagged `noisy` when its probes differ by more than 10 %, or when ours or
vLLM's runs differ from each other by more than 10 % on a headline figure (bench/peer_stats.py).

Printed per dtype: both sides' absolute figures (medians over the runs), then peer_ratio_c1/c8/c16 (our tok/s
over vLLM's), peer_ttft_ratio_c8, prefix_ttft_ratio (our cached turn over our cold one), peer_prefix_ttft_ratio
(our cached turn over vLLM's), peer_cold_ttft_ratio (our cold turn over vLLM's), each suffixed _fp32 or _bf16
and marked `noisy` when the runs were; then vllm_bench_serve_ok. Results: bench/results/peer.json.

Never both servers up at once: on a 2-core box an idle peer still steals cycles (vLLM's engine busy-polls).
Nothing else may run on the box meanwhile. About 25 minutes on a quiet box. Install vLLM first:
bench/install_vllm_peer.sh (`make bench-peer` does). `--skip-vllm --quick` smoke-tests our side alone.
"""

from __future__ import annotations

import argparse
import json
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from bench.cpu_probe import probe_gflops
from bench.peer_runs import VLLM_VENV, run_ours, run_vllm
from bench.peer_stats import RATIOS, alternation, median_figures, noise_reasons, ratios
from bench.peer_workload import FULL, QUICK, Workload
from devstack.triton import REPO_ROOT

RESULTS = REPO_ROOT / "bench" / "results" / "peer.json"
DTYPES = {"float32": "fp32", "bfloat16": "bf16"}


def run_dtype(dtype: str, sides: tuple[str, ...], runs_each: int, workload: Workload, log_root: Path,
              bench_serve: bool) -> dict:
    """Every alternated run of one dtype, with the probes around each; the figures, medians, ratios, verdict."""
    short = DTYPES[dtype]
    runs: list[dict] = []
    bench_ok = None
    counts = dict.fromkeys(sides, 0)
    for side in alternation(runs_each, sides):
        counts[side] += 1
        label = f"{short}-{side}-{counts[side]}"
        log_dir = log_root / label
        log_dir.mkdir()
        before = probe_gflops()
        print(f"[{label}] cpu probe before: {before:.1f} GFLOP/s", flush=True)
        started = time.monotonic()
        if side == "ours":
            want_serve = bench_serve and bench_ok is None
            figures, ok = run_ours(dtype, log_dir, workload, bench_serve=want_serve)
            bench_ok = ok if want_serve else bench_ok
        else:
            figures = run_vllm(dtype, log_dir, workload)
        after = probe_gflops()
        print(f"[{label}] cpu probe after: {after:.1f} GFLOP/s ({time.monotonic() - started:.0f} s)", flush=True)
        runs.append({"side": side, "label": label, "probe_before": before, "probe_after": after,
                     "figures": figures})
    by_side = {side: [r["figures"] for r in runs if r["side"] == side] for side in sides}
    medians = {side: median_figures(side_runs) for side, side_runs in by_side.items()}
    probes = [p for r in runs for p in (r["probe_before"], r["probe_after"])]
    reasons = noise_reasons(probes, by_side)
    result = {"dtype": dtype, "runs": runs, "medians": medians, "noisy": bool(reasons), "noisy_reasons": reasons,
              "vllm_bench_serve_ok": bench_ok}
    if "ours" in medians and "vllm" in medians:
        result["ratios"] = ratios(medians["ours"], medians["vllm"])
    return result


def report(result: dict) -> None:
    short = DTYPES[result["dtype"]]
    runs_each = max(sum(r["side"] == side for r in result["runs"]) for side in result["medians"])
    print(f"\n== {short}: medians over {runs_each} alternated run(s) each ==")
    print("| served | c1 tok/s | c8 | c16 | TTFT p50 c8 | 1.5k-token history turn: cold / cached TTFT |")
    print("|---|---|---|---|---|---|")
    for side, f in result["medians"].items():
        print(f"| {side}, {short} | {f['tok_s_c1']:.1f} | {f['tok_s_c8']:.1f} | {f['tok_s_c16']:.1f} | "
              f"{f['ttft_p50_c8']:.3f} s | {f['cold_ttft']:.3f} s / {f['cached_ttft']:.3f} s |")
    for run in result["runs"]:
        f = run["figures"]
        print(f"  {run['label']}: c1 {f['tok_s_c1']:.1f}  c8 {f['tok_s_c8']:.1f}  c16 {f['tok_s_c16']:.1f}  "
              f"ttft c8 {f['ttft_p50_c8']:.3f}  cold {f['cold_ttft']:.3f}  cached {f['cached_ttft']:.3f}  "
              f"probe {run['probe_before']:.1f} -> {run['probe_after']:.1f} GFLOP/s")
    for reason in result["noisy_reasons"]:
        print(f"  noisy: {reason}")
    print(f"peer_noisy_{short}: {int(result['noisy'])}")
    mark = "  noisy" if result["noisy"] else ""
    for key in RATIOS if "ratios" in result else ():
        print(f"{key}_{short}: {result['ratios'][key]:.3f}{mark}")
    sys.stdout.flush()


def _cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _commit() -> str:
    try:
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=REPO_ROOT, capture_output=True,
                              text=True, check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--skip-vllm", action="store_true", help="measure our stack only (no ratios)")
    parser.add_argument("--dtypes", default="float32,bfloat16", help="comma-separated, of: " + ", ".join(DTYPES))
    parser.add_argument("--runs", type=int, default=2, help="runs of each server per dtype, alternated")
    parser.add_argument("--quick", action="store_true",
                        help="a smoke check: one run a side, one round, 16 new tokens (always noisy)")
    opts = parser.parse_args()
    dtypes = [d.strip() for d in opts.dtypes.split(",") if d.strip()]
    unknown = [d for d in dtypes if d not in DTYPES]
    if unknown or not dtypes:
        parser.error(f"--dtypes: unknown {unknown}; choose from {', '.join(DTYPES)}")
    have_vllm = (VLLM_VENV / "bin" / "python").exists()
    if not have_vllm and not opts.skip_vllm:
        sys.exit(f"no vLLM venv at {VLLM_VENV}: run bench/install_vllm_peer.sh first")
    runs_each, workload = (1, QUICK) if opts.quick else (opts.runs, FULL)
    sides = ("ours",) if opts.skip_vllm else ("ours", "vllm")
    log_root = Path(tempfile.mkdtemp(prefix="bench-peer-"))
    print(f"logs: {log_root}", flush=True)
    results: dict[str, Any] = {"commit": _commit(), "cpu": _cpu_name(), "rounds": workload.rounds,
                               "new_tokens": workload.new_tokens, "runs_each": runs_each,
                               "order": alternation(runs_each, sides), "dtypes": {}}
    bench_ok = None
    for dtype in dtypes:
        result = run_dtype(dtype, sides, runs_each, workload, log_root, bench_serve=have_vllm and bench_ok is None)
        bench_ok = result["vllm_bench_serve_ok"] if bench_ok is None else bench_ok
        results["dtypes"][DTYPES[dtype]] = result
    for result in results["dtypes"].values():
        report(result)
    results["vllm_bench_serve_ok"] = bench_ok
    print(f"vllm_bench_serve_ok: {'n/a' if bench_ok is None else int(bench_ok)}")
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    RESULTS.write_text(json.dumps(results, indent=2))
    print(f"results: {RESULTS}", flush=True)


if __name__ == "__main__":
    main()
