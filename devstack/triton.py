"""Start a local tritonserver on a model repository, with the Python backend seeing this venv.

Uses a `tritonserver` on PATH when there is one (the NGC container), else the binary bundled in
the `nvidia-pytriton` wheel. The Python backend stub must load the *same* libpython as this
interpreter (the system libpython is another patch release and breaks `import torch`), so the
interpreter's LIBDIR goes first on LD_LIBRARY_PATH.
"""

from __future__ import annotations

import json
import os
import shutil
import site
import subprocess
import sys
import sysconfig
import time
import urllib.request
from dataclasses import dataclass
from pathlib import Path

from devstack.children import start_child

REPO_ROOT = Path(__file__).resolve().parents[1]


@dataclass
class TritonPorts:
    http: int = 8000
    grpc: int = 8001
    metrics: int = 8002


def _bundled_root() -> Path:
    import pytriton

    return Path(pytriton.__file__).parent / "tritonserver"


def backend_directory(build_dir: Path) -> Path:
    """A backends/ folder whose python backend holds the stub for this interpreter's version."""
    root = _bundled_root()
    target = build_dir / "backends" / "python"
    target.mkdir(parents=True, exist_ok=True)
    version = f"{sys.version_info.major}.{sys.version_info.minor}"
    files = {
        "libtriton_python.so": root / "backends" / "python" / "libtriton_python.so",
        "triton_python_backend_utils.py": root / "backends" / "python" / "triton_python_backend_utils.py",
        "triton_python_backend_stub": root / "python_backend_stubs" / version / "triton_python_backend_stub",
    }
    for name, source in files.items():
        link = target / name
        if not link.exists():
            link.symlink_to(source)
    return target.parent


TRITON_KEEPALIVE_ARGS = ("--grpc-http2-min-recv-ping-interval-without-data=10000", "--grpc-http2-max-ping-strikes=0")
# Every model loaded at start, and the repository API open: the gateway reloads a model whose process died
# (unload + load, gateway/supervisor.py). Triton's default mode ("none") refuses both calls.
TRITON_MODEL_CONTROL_ARGS = ("--model-control-mode=explicit", "--load-model=*")


def triton_command(repo: Path, ports: TritonPorts, build_dir: Path, extra: list[str] | None = None) -> list[str]:
    system = shutil.which("tritonserver")
    args = [
        f"--model-repository={repo}",
        f"--http-port={ports.http}",
        f"--grpc-port={ports.grpc}",
        f"--metrics-port={ports.metrics}",
        "--log-verbose=0",
        "--exit-timeout-secs=10",
        # the gateway pings every 30 s (dead-peer detection); Triton's default answers pings sent more often than
        # every 5 min without data (a long blocking generation) with GOAWAY too_many_pings, killing every stream
        *TRITON_KEEPALIVE_ARGS,
        *TRITON_MODEL_CONTROL_ARGS,
    ] + (extra or [])
    if system:
        return [system, *args]
    return [str(_bundled_root() / "bin" / "tritonserver"), f"--backend-directory={backend_directory(build_dir)}", *args]


def triton_env(base: dict[str, str] | None = None) -> dict[str, str]:
    env = dict(base if base is not None else os.environ)
    libdir = sysconfig.get_config_var("LIBDIR") or ""
    bundled_libs = str(_bundled_root().parent.parent / "nvidia_pytriton.libs")
    env["LD_LIBRARY_PATH"] = os.pathsep.join(p for p in (libdir, bundled_libs, env.get("LD_LIBRARY_PATH", "")) if p)
    # the stub runs libpython isolated from PYTHONPATH; model.py adds these (repo for `engine`, venv packages)
    env["SIE_PYTHONPATH"] = os.pathsep.join([str(REPO_ROOT), *site.getsitepackages()])
    env.setdefault("SIE_MODEL_CACHE", str(REPO_ROOT / ".cache" / "models"))
    if env.get("SIE_MKL_INTEL_KERNELS") == "1":
        from devstack.mkl import preload_library

        library = str(preload_library(REPO_ROOT / "build"))
        env["LD_PRELOAD"] = os.pathsep.join(p for p in (library, env.get("LD_PRELOAD", "")) if p)
    return env


def start_triton(
    repo: Path, ports: TritonPorts, log_path: Path | None = None, extra: list[str] | None = None,
    extra_env: dict[str, str] | None = None,
) -> subprocess.Popen:
    build_dir = REPO_ROOT / "build"
    out = open(log_path, "ab") if log_path else None  # noqa: SIM115 - handed to the child process
    return start_child(
        triton_command(repo, ports, build_dir, extra),
        env={**triton_env(), **(extra_env or {})},
        stdout=out or None,
        stderr=subprocess.STDOUT if out else None,
    )


def wait_ready(ports: TritonPorts, proc: subprocess.Popen | None = None, timeout: float = 300.0) -> None:
    """Block until Triton reports ready (all models loaded) or fail if the process dies."""
    deadline = time.monotonic() + timeout
    url = f"http://127.0.0.1:{ports.http}/v2/health/ready"
    while time.monotonic() < deadline:
        if proc is not None and proc.poll() is not None:
            raise RuntimeError(f"tritonserver exited with code {proc.returncode}")
        try:
            with urllib.request.urlopen(url, timeout=2) as response:
                if response.status == 200:
                    return
        except OSError:
            pass
        time.sleep(0.5)
    raise TimeoutError("tritonserver did not become ready in time")


# A model that fails to load (e.g. one the engine refuses) leaves tritonserver running, the model UNAVAILABLE with its
# reason, and the others serving; without it, one refused model stops the whole server at start.
KEEP_SERVING_ARGS = ["--exit-on-error=false"]


@dataclass
class ModelState:
    name: str
    state: str  # READY, UNAVAILABLE, LOADING, ...
    reason: str = ""

    @property
    def first_reason_line(self) -> str:
        """Triton's reason without the Python traceback that follows it ("Internal: UnsupportedModel: ...")."""
        return self.reason.split("\n\nAt:", 1)[0].strip()


def model_states(ports: TritonPorts) -> list[ModelState]:
    """Every model of the repository index, with its state and, for a failed load, Triton's reason."""
    request = urllib.request.Request(f"http://127.0.0.1:{ports.http}/v2/repository/index", data=b"{}", method="POST")
    with urllib.request.urlopen(request, timeout=5) as response:
        index = json.load(response)
    return [ModelState(m["name"], m.get("state", ""), m.get("reason", "")) for m in index]


def wait_loaded(ports: TritonPorts, proc: subprocess.Popen | None = None, timeout: float = 300.0) -> list[ModelState]:
    """Block until every model has loaded or failed to (a server started with KEEP_SERVING_ARGS); their states.

    Unlike `wait_ready` (Triton's strict readiness: every model READY), a refused model does not make this wait
    out its timeout."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc is not None and proc.poll() is not None:
            raise RuntimeError(f"tritonserver exited with code {proc.returncode}")
        try:  # Triton answers once its start-up loads are over (an empty list: an empty repository)
            states = model_states(ports)
            if all(s.state in ("READY", "UNAVAILABLE") for s in states):
                return states
        except OSError:
            pass
        time.sleep(0.5)
    raise TimeoutError("tritonserver did not finish loading its models in time")
