"""A local stack on free ports: tritonserver on a model repository, then the gateway, both stopped on exit.

Shared by the e2e fixture, the gateway benchmark and the soak script.
"""

from __future__ import annotations

import contextlib
import subprocess
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from devstack.net import free_port, wait_http
from devstack.serve import start_gateway, stop
from devstack.triton import KEEP_SERVING_ARGS, ModelState, TritonPorts, start_triton, wait_loaded, wait_ready


@dataclass
class LocalStack:
    triton_ports: TritonPorts
    gateway_port: int
    triton: subprocess.Popen
    gateway: subprocess.Popen
    log_dir: Path
    models: list[ModelState] | None = None  # with keep_serving: every model's load state and reason

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.gateway_port}"


@contextlib.contextmanager
def local_stack(repo: Path, log_dir: Path, workers: int = 2, extra_env: dict[str, str] | None = None,
                triton_timeout: float = 300.0, keep_serving: bool = False,
                triton_env: dict[str, str] | None = None, engine_metrics: bool = False) -> Iterator[LocalStack]:
    """`keep_serving`: a model that fails to load leaves the others served (its state and reason in `models`)
    instead of stopping tritonserver; the stack then waits for every load to end, not for all to be READY.
    `engine_metrics`: the gateway's /metrics also carries the engine's gauges under vLLM's names, read from this
    stack's Triton, as the gateway beside its own Triton in an inference-pool pod does (docs/deploy.md)."""
    ports = TritonPorts(free_port(), free_port(), free_port())
    triton = start_triton(repo, ports, log_dir / "triton.log", extra=KEEP_SERVING_ARGS if keep_serving else None,
                          extra_env=triton_env)
    gateway = None
    try:
        models = None
        if keep_serving:
            models = wait_loaded(ports, triton, timeout=triton_timeout)
        else:
            wait_ready(ports, triton, timeout=triton_timeout)
        port = free_port()
        if engine_metrics:
            extra_env = {**(extra_env or {}), "SIE_ENGINE_METRICS_URL": f"http://127.0.0.1:{ports.metrics}/metrics"}
        gateway = start_gateway(ports.grpc, port, workers=workers, log_path=log_dir / "gateway.log",
                                extra_env=extra_env)
        wait_http(f"http://127.0.0.1:{port}/readyz")
        yield LocalStack(ports, port, triton, gateway, log_dir, models)
    finally:
        stop(gateway)
        stop(triton)
