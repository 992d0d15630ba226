"""Run the locust load test headless for a bounded time and print a one-line summary.

    python loadtest/run.py [--users N] [--spawn-rate R] [--duration 60s] [--host URL] [--out DIR]
                           [--classes "ChatStreamUser GenerateStreamUser"]

Every option has an environment default (SIE_LOADTEST_USERS, SIE_LOADTEST_SPAWN_RATE, SIE_LOADTEST_DURATION,
SIE_LOADTEST_HOST, SIE_LOADTEST_OUT, SIE_LOADTEST_CLASSES). Writes OUT/loadtest_stats.csv (and the other locust
CSVs), OUT/report.html and OUT/loadtest_summary.json. Exit status: 0 when requests were served and none failed
(deliberate 503 QUEUE_FULL back-pressure is not a failure), 1 when any request failed, 2 when nothing was measured.
"""

from __future__ import annotations

import argparse
import csv
import json
import os
import pathlib
import subprocess
import sys
from typing import Any

HERE = pathlib.Path(__file__).resolve().parent
LOCUSTFILE = HERE / "locustfile.py"
PREFIX = "loadtest"
TTFT_TYPE = "TTFT"
BACKPRESSURE_NAME = "backpressure 503"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    env = os.environ.get
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--users", "-u", type=int, default=int(env("SIE_LOADTEST_USERS", "8")))
    parser.add_argument(
        "--spawn-rate",
        "-r",
        type=float,
        default=None,
        help="users started per second (default: SIE_LOADTEST_SPAWN_RATE, else all within ~2 s)",
    )
    parser.add_argument(
        "--duration", "-t", default=env("SIE_LOADTEST_DURATION", "60s"), help="locust run time, e.g. 60s, 5m"
    )
    parser.add_argument("--host", default=env("SIE_LOADTEST_HOST", "http://127.0.0.1:8080"))
    parser.add_argument(
        "--out", type=pathlib.Path, default=pathlib.Path(env("SIE_LOADTEST_OUT", str(HERE / "results")))
    )
    parser.add_argument(
        "--classes", default=env("SIE_LOADTEST_CLASSES", ""), help="space-separated user classes (default: all four)"
    )
    args = parser.parse_args(argv)
    if args.spawn_rate is None:
        rate = env("SIE_LOADTEST_SPAWN_RATE")
        args.spawn_rate = float(rate) if rate else max(1.0, args.users / 2)
    return args


def run_locust(args: argparse.Namespace, summary_path: pathlib.Path) -> int:
    """Run locust in this interpreter's environment; returns its exit status (1 on any failure)."""
    args.out.mkdir(parents=True, exist_ok=True)
    for stale in [*args.out.glob(f"{PREFIX}_*.csv"), summary_path]:
        stale.unlink(missing_ok=True)
    cmd = [
        sys.executable,
        "-m",
        "locust",
        "-f",
        str(LOCUSTFILE),
        "--headless",
        "-u",
        str(args.users),
        "-r",
        str(args.spawn_rate),
        "-t",
        str(args.duration),
        "--host",
        args.host,
        "--csv",
        str(args.out / PREFIX),
        "--html",
        str(args.out / "report.html"),
        "--stop-timeout",
        "60",  # let in-flight streams finish rather than cut them (and their stats) off
        "--only-summary",
        *args.classes.split(),
    ]
    env = {**os.environ, "SIE_LOADTEST_SUMMARY": str(summary_path)}
    print("+ " + " ".join(cmd), flush=True)
    return subprocess.call(cmd, env=env)


def read_rows(stats_csv: pathlib.Path) -> list[dict[str, str]]:
    with stats_csv.open(newline="", encoding="utf-8") as fh:
        return [row for row in csv.DictReader(fh) if row["Name"] != "Aggregated"]


def figures_from_csv(rows: list[dict[str, str]]) -> dict[str, Any]:
    """Counts from the stats CSV: the fallback when the locustfile wrote no summary."""
    served = [r for r in rows if r["Type"] != TTFT_TYPE and r["Name"] != BACKPRESSURE_NAME]
    ttft = [r for r in rows if r["Type"] == TTFT_TYPE]

    def one(group: list[dict[str, str]], col: str) -> str | None:
        return group[0][col] if len(group) == 1 else None  # percentiles of several rows do not merge

    return {
        "served": {
            "count": sum(int(r["Request Count"]) for r in served),
            "req_per_s": sum(float(r["Requests/s"]) for r in served),
            "p50_ms": one(served, "50%"),
            "p99_ms": one(served, "99%"),
        },
        "backpressure": {"count": sum(int(r["Request Count"]) for r in rows if r["Name"] == BACKPRESSURE_NAME)},
        "ttft": {"p50_ms": one(ttft, "50%"), "p99_ms": one(ttft, "99%")},
        "failures": sum(int(r["Failure Count"]) for r in rows),
    }


def fmt_ms(value: Any) -> str:
    return "n/a" if value is None else f"{float(value):.0f}ms"


def summary_line(figures: dict[str, Any]) -> str:
    served, ttft = figures["served"], figures["ttft"]
    return (
        f"loadtest: requests={served['count']} failures={figures['failures']} "
        f"backpressure_503={figures['backpressure']['count']} "
        f"ttft_p50={fmt_ms(ttft.get('p50_ms'))} ttft_p99={fmt_ms(ttft.get('p99_ms'))} "
        f"total_p50={fmt_ms(served.get('p50_ms'))} total_p99={fmt_ms(served.get('p99_ms'))} "
        f"req_per_s={served['req_per_s']:.2f}"
    )


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    summary_path = args.out / f"{PREFIX}_summary.json"
    locust_rc = run_locust(args, summary_path)
    stats_csv = args.out / f"{PREFIX}_stats.csv"
    if not stats_csv.exists():
        print(f"loadtest: locust wrote no stats (exit status {locust_rc})", file=sys.stderr)
        return 2
    csv_figures = figures_from_csv(read_rows(stats_csv))
    # The summary is taken after the last request finished; the CSV may be up to a second older.
    figures = json.loads(summary_path.read_text()) if summary_path.exists() else csv_figures
    failures = max(int(figures["failures"]), int(csv_figures["failures"]))
    figures["failures"] = failures
    print(f"report: {args.out / 'report.html'}  csv: {args.out / PREFIX}_stats.csv")
    print(summary_line(figures), flush=True)
    if failures:
        return 1
    if locust_rc != 0:
        # No failed request, yet locust failed: an exception in the locustfile, or a crash.
        print(f"loadtest: locust exited with status {locust_rc}", file=sys.stderr)
        return 1
    if figures["served"]["count"] == 0:
        print("loadtest: no request was served", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
