"""`make serve`: tritonserver on the model repository, then gunicorn serving the gateway.

Ctrl-C or SIGTERM stops both (their whole process groups), and nothing is left running.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from devstack.triton import REPO_ROOT, TritonPorts, start_triton, wait_ready


def _ports() -> TritonPorts:
    env = os.environ
    return TritonPorts(
        http=int(env.get("TRITON_HTTP_PORT", "8000")),
        grpc=int(env.get("TRITON_GRPC_PORT", "8001")),
        metrics=int(env.get("TRITON_METRICS_PORT", "8002")),
    )


def start_gateway(grpc_port: int, gateway_port: int, extra_env: dict[str, str] | None = None,
                  workers: int | None = None, log_path: Path | None = None) -> subprocess.Popen:
    env = dict(os.environ)
    env.setdefault("TRITON_GRPC_URL", f"localhost:{grpc_port}")
    env["GATEWAY_PORT"] = str(gateway_port)
    if workers is not None:
        env["GATEWAY_WORKERS"] = str(workers)
    env.update(extra_env or {})
    out = open(log_path, "ab") if log_path else None  # noqa: SIM115 - handed to the child process
    return subprocess.Popen(
        [sys.executable, "-m", "gunicorn", "-c", str(REPO_ROOT / "docker" / "gunicorn.conf.py"), "gateway.asgi:app"],
        cwd=REPO_ROOT, env=env, start_new_session=True, stdout=out or None, stderr=subprocess.STDOUT if out else None,
    )


def stop(proc: subprocess.Popen | None, timeout: float = 20.0) -> None:
    """SIGTERM the process group, then SIGKILL whatever is left.

    "Whatever is left" includes members that outlive the leader: when tritonserver gives up at
    its exit timeout, its Python-backend stub (same group) keeps running, holding the model.
    """
    if proc is None:
        return
    if proc.poll() is None:
        try:
            os.killpg(proc.pid, signal.SIGTERM)
            proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        except ProcessLookupError:
            pass
    try:  # the group id is ours while any member lives (start_new_session made the leader its own group)
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


def main() -> None:
    ports = _ports()
    gateway_port = int(os.environ.get("GATEWAY_PORT", "8080"))
    repo = Path(os.environ.get("SIE_MODEL_REPOSITORY", REPO_ROOT / "model_repository")).resolve()
    triton = gateway = None

    def shutdown(*_: object) -> None:
        stop(gateway)
        stop(triton)
        sys.exit(0)

    signal.signal(signal.SIGTERM, shutdown)
    signal.signal(signal.SIGINT, shutdown)
    started = time.monotonic()
    print(f"starting tritonserver (http {ports.http}, grpc {ports.grpc}, metrics {ports.metrics})", flush=True)
    triton = start_triton(repo, ports)
    try:
        wait_ready(ports, triton)
        print(f"tritonserver ready after {time.monotonic() - started:.1f}s; starting gateway on :{gateway_port}",
              flush=True)
        gateway = start_gateway(ports.grpc, gateway_port)
        while triton.poll() is None and gateway.poll() is None:
            time.sleep(0.5)
        print("a child process exited; stopping", flush=True)
    finally:
        shutdown()


if __name__ == "__main__":
    main()
