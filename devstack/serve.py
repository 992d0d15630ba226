"""`make serve`: tritonserver on the model repository, then gunicorn serving the gateway.

Which models (environment, as the Makefile passes them):
- `MODEL=<folder>`: that Hugging Face model folder alone, in a repository written for it by devstack.add_model
  (served as `SERVED_NAME`, else the config's `_name_or_path`, else the folder's name; `MODEL_KIND` cpu or gpu;
  `KV_CACHE_DTYPE` its profile's `kv_cache_dtype`, `QUANTIZATION` its `quantization`);
- `MODEL_REPOSITORY=<dir>` (or `SIE_MODEL_REPOSITORY`): a model repository of the user's own;
- neither: this repository's model_repository/.

A model that fails to load (one the engine refuses, say) is reported with Triton's reason and the others are
served; when none loads, this exits non-zero with the reason on its last line. Ctrl-C or SIGTERM stops both
servers (their whole process groups), and nothing is left running; killed outright (SIGKILL), it takes both
servers with it (devstack.children).
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

from devstack.children import start_child
from devstack.triton import KEEP_SERVING_ARGS, REPO_ROOT, ModelState, TritonPorts, start_triton, wait_loaded


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
    return start_child(
        [sys.executable, "-m", "gunicorn", "-c", str(REPO_ROOT / "docker" / "gunicorn.conf.py"), "gateway.asgi:app"],
        cwd=REPO_ROOT, env=env, stdout=out or None, stderr=subprocess.STDOUT if out else None,
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
    try:  # the group id is ours while any member lives (start_child made the leader its own group)
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


def model_repository(env: dict[str, str], build_dir: Path = REPO_ROOT / "build") -> Path:
    """The repository to serve: one written for MODEL (under `build_dir`), else MODEL_REPOSITORY, else
    model_repository/."""
    if env.get("MODEL"):
        from devstack.add_model import add_model

        repo = build_dir / "serve-repository"
        shutil.rmtree(repo, ignore_errors=True)  # MODEL alone: nothing left from an earlier MODEL
        target = add_model(Path(env["MODEL"]).expanduser(), repo, name=env.get("SERVED_NAME") or None,
                           kind=env.get("MODEL_KIND", "cpu"), kv_cache_dtype=env.get("KV_CACHE_DTYPE") or "auto",
                           quantization=env.get("QUANTIZATION") or "none")
        print(f"serving {env['MODEL']} as Triton model {target.name} ({target / 'config.pbtxt'})", flush=True)
        return repo
    own = env.get("MODEL_REPOSITORY") or env.get("SIE_MODEL_REPOSITORY")
    return Path(own).expanduser().resolve() if own else REPO_ROOT / "model_repository"


def report_unavailable(states: list[ModelState]) -> bool:
    """Print each model that failed to load with Triton's reason; whether any model is ready."""
    for model in states:
        if model.state != "READY":
            print(f"model {model.name} is {model.state}: {model.first_reason_line}", flush=True)
    return any(model.state == "READY" for model in states)


def main() -> None:
    ports = _ports()
    gateway_port = int(os.environ.get("GATEWAY_PORT", "8080"))
    try:
        repo = model_repository(dict(os.environ))
    except (OSError, ValueError) as exc:
        sys.exit(f"cannot serve MODEL={os.environ.get('MODEL')}: {exc}")
    triton = gateway = None

    def stop_all() -> None:
        stop(gateway)
        stop(triton)

    def shutdown(*_: object) -> None:
        stop_all()
        sys.exit(0)

    signal.signal(signal.SIGTERM, shutdown)
    signal.signal(signal.SIGINT, shutdown)
    started = time.monotonic()
    print(f"starting tritonserver on {repo} (http {ports.http}, grpc {ports.grpc}, metrics {ports.metrics})",
          flush=True)
    triton = start_triton(repo, ports, extra=KEEP_SERVING_ARGS)
    try:
        states = wait_loaded(ports, triton)
        if not report_unavailable(states):
            stop_all()
            reasons = [f"{m.name}: {m.first_reason_line}" for m in states] or [f"{repo} holds no model"]
            sys.exit("no model could be served; " + "; ".join(reasons))
        print(f"tritonserver ready after {time.monotonic() - started:.1f}s; starting gateway on :{gateway_port}",
              flush=True)
        gateway = start_gateway(ports.grpc, gateway_port)
        while triton.poll() is None and gateway.poll() is None:
            time.sleep(0.5)
        print("a child process exited; stopping", flush=True)
    finally:
        stop_all()


if __name__ == "__main__":
    main()
