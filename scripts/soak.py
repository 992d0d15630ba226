"""Load + memory soak: start the local stack, run locust headless, sample the RSS of the gateway (gunicorn
master and workers) and of tritonserver (with its model stubs) every 30 s, and fail when memory grew.

    python scripts/soak.py --users 64 --duration 15m

Exit status: locust's own when it failed; else 1 when the gateway's or tritonserver's RSS grew by more than
`--max-growth-pct` (2 %) between minute `--from-minute` (3: start-up, model warm-up and allocator arenas
are done by then) and the end of the run; else 0.
"""

from __future__ import annotations

import argparse
import re
import subprocess
import sys
import threading
import time
from pathlib import Path

import psutil

from devstack.stack import local_stack
from devstack.triton import REPO_ROOT

SAMPLE_S = 30.0


def _tree_rss_mb(pid: int) -> float:
    try:
        root = psutil.Process(pid)
        procs = [root, *root.children(recursive=True)]
        return sum(p.memory_info().rss for p in procs if p.is_running()) / 2**20
    except psutil.NoSuchProcess:
        return 0.0


def duration_s(text: str) -> float:
    """locust's `--run-time` forms: `90`, `90s`, `15m`, `1h30m`."""
    parts = re.findall(r"(\d+(?:\.\d+)?)([hms]?)", text.strip())
    if not parts or "".join(n + u for n, u in parts) != text.strip():
        raise argparse.ArgumentTypeError(f"not a duration: {text!r}")
    return sum(float(n) * {"h": 3600, "m": 60, "s": 1, "": 1}[u] for n, u in parts)


def growth_pct(samples: list[tuple[float, float, float]], from_s: float) -> tuple[float, float] | None:
    """RSS growth (gateway, triton) from the first sample at or after `from_s` to the last sample."""
    window = [s for s in samples if s[0] >= from_s]
    if len(window) < 2:
        return None
    first, last = window[0], window[-1]
    return 100 * (last[1] - first[1]) / first[1], 100 * (last[2] - first[2]) / first[2]


def grew_too_much(growth: tuple[float, float], max_pct: float) -> list[str]:
    """Which of (gateway, tritonserver) grew by more than `max_pct`."""
    return [name for name, pct in zip(("gateway", "tritonserver"), growth, strict=True) if pct > max_pct]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--users", type=int, default=64)
    parser.add_argument("--duration", default="15m")
    parser.add_argument("--classes", default="ChatStreamUser GenerateStreamUser")
    parser.add_argument("--from-minute", type=float, default=3.0)
    parser.add_argument("--max-growth-pct", type=float, default=2.0)
    args = parser.parse_args()
    if duration_s(args.duration) <= args.from_minute * 60 + 2 * SAMPLE_S:
        parser.error(f"--duration must run well past minute {args.from_minute:g} to judge memory growth")
    logs = Path("loadtest/results")
    logs.mkdir(parents=True, exist_ok=True)
    samples: list[tuple[float, float, float]] = []
    done = threading.Event()
    with local_stack(REPO_ROOT / "model_repository", logs) as running:
        started = time.monotonic()

        def sample() -> None:
            while not done.wait(SAMPLE_S):
                samples.append((time.monotonic() - started, _tree_rss_mb(running.gateway.pid),
                                _tree_rss_mb(running.triton.pid)))

        threading.Thread(target=sample, daemon=True).start()
        result = subprocess.run([sys.executable, "loadtest/run.py", "--users", str(args.users), "--duration",
                                 args.duration, "--host", running.base_url, "--out", str(logs),
                                 "--classes", args.classes], cwd=REPO_ROOT, check=False)
        done.set()
    for t, gw, tr in samples:
        print(f"memory t={t:5.0f}s gateway_mb={gw:8.1f} triton_mb={tr:8.1f}")
    growth = growth_pct(samples, args.from_minute * 60)
    if result.returncode != 0:
        sys.exit(result.returncode)
    if growth is None:
        print(f"memory: too few samples after minute {args.from_minute:g}")
        sys.exit(1)
    gateway_pct, triton_pct = growth
    print(f"memory_growth_gateway_pct (minute {args.from_minute:g} to end): {gateway_pct:.1f}")
    print(f"memory_growth_triton_pct (minute {args.from_minute:g} to end): {triton_pct:.1f}")
    grew = grew_too_much(growth, args.max_growth_pct)
    if grew:
        print(f"FAIL: {' and '.join(grew)} memory grew more than {args.max_growth_pct:g} %")
        sys.exit(1)
    print(f"memory flat: both within {args.max_growth_pct:g} %")


if __name__ == "__main__":
    main()
