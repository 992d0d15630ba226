"""Load + memory soak: start the local stack, run locust headless, sample RSS of the gateway and of
tritonserver (with its model stubs) every 30 s, and report whether memory stayed flat (issue 6).

    python scripts/soak.py --users 64 --duration 5m
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import threading
import time
from pathlib import Path

import psutil

from devstack.stack import local_stack
from devstack.triton import REPO_ROOT


def _tree_rss_mb(pid: int) -> float:
    try:
        root = psutil.Process(pid)
        procs = [root, *root.children(recursive=True)]
        return sum(p.memory_info().rss for p in procs if p.is_running()) / 2**20
    except psutil.NoSuchProcess:
        return 0.0


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--users", type=int, default=64)
    parser.add_argument("--duration", default="5m")
    parser.add_argument("--classes", default="ChatStreamUser GenerateStreamUser")
    args = parser.parse_args()
    logs = Path("loadtest/results")
    logs.mkdir(parents=True, exist_ok=True)
    samples: list[tuple[float, float, float]] = []
    done = threading.Event()
    with local_stack(REPO_ROOT / "model_repository", logs) as running:
        started = time.monotonic()

        def sample() -> None:
            while not done.wait(30):
                samples.append((time.monotonic() - started, _tree_rss_mb(running.gateway.pid),
                                _tree_rss_mb(running.triton.pid)))

        threading.Thread(target=sample, daemon=True).start()
        result = subprocess.run([sys.executable, "loadtest/run.py", "--users", str(args.users), "--duration",
                                 args.duration, "--host", running.base_url, "--out", str(logs),
                                 "--classes", args.classes], cwd=REPO_ROOT, check=False)
        done.set()
    for t, gw, tr in samples:
        print(f"memory t={t:5.0f}s gateway_mb={gw:8.1f} triton_mb={tr:8.1f}")
    first = next((s for s in samples if s[0] >= 60), None)
    if first and samples:
        last = samples[-1]
        print(f"memory_growth_gateway_pct: {100 * (last[1] - first[1]) / first[1]:.1f}")
        print(f"memory_growth_triton_pct: {100 * (last[2] - first[2]) / first[2]:.1f}")
    sys.exit(result.returncode)


if __name__ == "__main__":
    main()
