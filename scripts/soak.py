"""Load + memory soak: start the local stack, run locust headless, sample the RSS of the gateway (gunicorn
master and workers) and of tritonserver (the server with its model instances, the Python-backend stubs running
the engine) every 30 s, and fail when memory grew. The server process and the model instances are also printed
apart, to show where growth is; the verdict is on the two services, since a ~55 MB server process moves by more
than 2 % on one allocator step.

    python scripts/soak.py --users 64 --duration 15m

Growth is read from a least-squares line through the samples from minute `--from-minute` (3: start-up, model
warm-up and allocator arenas are done by then) to the end, so one sample caught just after the allocator gave
memory back (or just before) cannot decide the verdict; the first and last samples are printed beside it.

Exit status: locust's own when it failed; else 1 when the gateway or tritonserver grew by more than
`--max-growth-pct` (2 %) over that window; else 0.
"""

from __future__ import annotations

import argparse
import re
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

import psutil

from devstack.stack import local_stack
from devstack.triton import REPO_ROOT

SAMPLE_S = 30.0


GROUPS = ("gateway", "tritonserver", "tritonserver process", "model instances")
JUDGED = ("gateway", "tritonserver")


def _rss_mb(procs: list[psutil.Process]) -> float:
    total = 0
    for proc in procs:
        try:
            total += proc.memory_info().rss
        except psutil.NoSuchProcess:
            pass
    return total / 2**20


def sample_mb(gateway_pid: int, triton_pid: int) -> dict[str, float]:
    """RSS of the gateway's process tree and of tritonserver's (then of the server alone and of its stubs)."""
    try:
        gateway = psutil.Process(gateway_pid)
        triton = psutil.Process(triton_pid)
        server, models = _rss_mb([triton]), _rss_mb(triton.children(recursive=True))
        return {"gateway": _rss_mb([gateway, *gateway.children(recursive=True)]), "tritonserver": server + models,
                "tritonserver process": server, "model instances": models}
    except psutil.NoSuchProcess:
        return {}


def duration_s(text: str) -> float:
    """locust's `--run-time` forms: `90`, `90s`, `15m`, `1h30m`."""
    parts = re.findall(r"(\d+(?:\.\d+)?)([hms]?)", text.strip())
    if not parts or "".join(n + u for n, u in parts) != text.strip():
        raise argparse.ArgumentTypeError(f"not a duration: {text!r}")
    return sum(float(n) * {"h": 3600, "m": 60, "s": 1, "": 1}[u] for n, u in parts)


def judged_window(samples: list[tuple[float, dict[str, float]]], from_s: float) -> list[tuple[float, dict[str, float]]]:
    """The complete samples from `from_s` on (a sample taken while a process was gone is empty)."""
    return [(t, mb) for t, mb in samples if t >= from_s and set(mb) == set(GROUPS)]


def growth_pct(samples: list[tuple[float, dict[str, float]]], from_s: float) -> dict[str, float] | None:
    """Per group: growth from `from_s` to the last sample, in % of the start, along a least-squares line."""
    window = judged_window(samples, from_s)
    if len(window) < 3:
        return None
    times = [t for t, _ in window]
    growth = {}
    for group in GROUPS:
        slope, intercept = statistics.linear_regression(times, [mb[group] for _, mb in window])
        start = intercept + slope * times[0]
        growth[group] = 100 * slope * (times[-1] - times[0]) / start
    return growth


def grew_too_much(growth: dict[str, float], max_pct: float) -> list[str]:
    """Which of the judged services grew by more than `max_pct`."""
    return [group for group in JUDGED if growth[group] > max_pct]


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
    samples: list[tuple[float, dict[str, float]]] = []
    done = threading.Event()
    with local_stack(REPO_ROOT / "model_repository", logs) as running:
        started = time.monotonic()

        def sample() -> None:
            while not done.wait(SAMPLE_S):
                samples.append((time.monotonic() - started, sample_mb(running.gateway.pid, running.triton.pid)))

        threading.Thread(target=sample, daemon=True).start()
        result = subprocess.run([sys.executable, "loadtest/run.py", "--users", str(args.users), "--duration",
                                 args.duration, "--host", running.base_url, "--out", str(logs),
                                 "--classes", args.classes], cwd=REPO_ROOT, check=False)
        done.set()
    for t, mb in samples:
        print(f"memory t={t:5.0f}s " + " ".join(f"{g.replace(' ', '_')}_mb={mb.get(g, 0):8.1f}" for g in GROUPS))
    growth = growth_pct(samples, args.from_minute * 60)
    if result.returncode != 0:
        sys.exit(result.returncode)
    if growth is None:
        print(f"memory: too few samples after minute {args.from_minute:g}")
        sys.exit(1)
    window = judged_window(samples, args.from_minute * 60)
    for group in GROUPS:
        first, last = window[0][1][group], window[-1][1][group]
        print(f"memory_growth_{group.replace(' ', '_')}_pct (minute {args.from_minute:g} to end, fitted): "
              f"{growth[group]:.1f}  (samples {first:.1f} -> {last:.1f} MB)")
    grew = grew_too_much(growth, args.max_growth_pct)
    if grew:
        print(f"FAIL: {' and '.join(grew)} memory grew more than {args.max_growth_pct:g} %")
        sys.exit(1)
    print(f"memory flat: all within {args.max_growth_pct:g} %")


if __name__ == "__main__":
    main()
