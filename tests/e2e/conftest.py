"""A real tritonserver with the real model repository, and the real gateway under gunicorn, on free ports."""

from __future__ import annotations

import os
import shutil
import signal
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from devstack.net import free_port, wait_http
from devstack.serve import start_gateway, stop
from devstack.stack import LocalStack, local_stack
from devstack.triton import REPO_ROOT, TritonPorts, start_triton, wait_ready
from tests.helpers.prometheus import metric_value, scrape
from tests.tiny_vlm import ensure_tiny_vlm

MODEL = "HuggingFaceTB/SmolLM2-135M-Instruct"
STUB = "sie-test__stub-tokens"  # tests/stub_repository: no torch, emits N tokens
TOKEN = "tok-secret-5521"
SIE_MODEL = "HuggingFaceTB__SmolLM2-135M-Instruct"


@dataclass
class Stack:
    base_url: str
    triton: TritonPorts
    log_dir: Path
    triton_pid: int = 0

    def triton_metric(self, name: str, **labels: str) -> float:
        return metric_value(scrape(f"http://127.0.0.1:{self.triton.metrics}/metrics", timeout=5), name, **labels)


# package scope: the stacks go down when the e2e tests end, so they do not idle beside the unit tests
@pytest.fixture(scope="package")
def stack(tmp_path_factory) -> Iterator[Stack]:
    log_dir = tmp_path_factory.mktemp("stack-logs")
    ensure_tiny_vlm()  # model_repository/tiny_vlm serves it; `make model` normally built it already
    try:
        env = {"SIE_AUTH_MODE": "none", "SIE_RESPONSES_STORE": str(log_dir / "responses.sqlite3")}
        with local_stack(REPO_ROOT / "model_repository", log_dir, extra_env=env) as running:
            yield Stack(running.base_url, running.triton_ports, log_dir, running.triton.pid)
    finally:
        if os.environ.get("CI"):
            for name in ("triton.log", "gateway.log"):
                path = log_dir / name
                if path.exists():
                    print(f"--- tail of {name} ---\n" + path.read_text(errors="replace")[-3000:])


@pytest.fixture(scope="package")
def openai_client(stack: Stack):
    import openai

    return openai.OpenAI(base_url=stack.base_url + "/v1", api_key="unused", max_retries=0, timeout=120)


class StubStack:
    def __init__(self, tmp_path) -> None:
        self.logs = tmp_path
        self.ports = TritonPorts(free_port(), free_port(), free_port())
        self.triton = None
        self.start_triton()
        self.port = free_port()
        self.gateway = start_gateway(
            self.ports.grpc, self.port, workers=1, log_path=tmp_path / "gateway.log",
            extra_env={"SIE_AUTH_MODE": "token", "SIE_AUTH_TOKENS": TOKEN, "SIE_GATEWAY_MODEL_REFRESH_S": "1",
                       "GATEWAY_ACCESS_LOG": "1"})
        self.url = f"http://127.0.0.1:{self.port}"
        wait_http(self.url + "/readyz")
        self.headers = {"Authorization": f"Bearer {TOKEN}"}

    def start_triton(self) -> None:
        self.triton = start_triton(REPO_ROOT / "tests" / "stub_repository", self.ports, self.logs / "triton.log")
        wait_ready(self.ports, self.triton, timeout=120)

    def kill_triton(self) -> None:
        os.killpg(self.triton.pid, signal.SIGKILL)
        self.triton.wait()

    def close(self) -> None:
        stop(self.gateway)
        stop(self.triton)


@pytest.fixture(scope="package")
def stub(tmp_path_factory) -> Iterator[StubStack]:
    """tritonserver on the stub repository + a gateway with token auth (fast, restartable)."""
    s = StubStack(tmp_path_factory.mktemp("stub-stack"))
    yield s
    died = s.triton.poll()
    s.close()
    if died is not None and os.environ.get("CI"):  # every test after it failed: say why it went
        print(f"--- the stub's tritonserver exited ({died}); tail of its log ---\n"
              + (s.logs / "triton.log").read_text(errors="replace")[-3000:])


@pytest.fixture(scope="module")
def pod(tmp_path_factory) -> Iterator[LocalStack]:
    """An inference-pool pod's shape: SmolLM2 alone, the gateway beside its own Triton carrying the engine's gauges
    under vLLM's names on its /metrics (docs/deploy.md)."""
    root = tmp_path_factory.mktemp("pod")
    repo = root / "repository"
    shutil.copytree(REPO_ROOT / "model_repository" / "smollm2_135m_instruct", repo / "smollm2_135m_instruct")
    with local_stack(repo, root, extra_env={"SIE_AUTH_MODE": "none"}, engine_metrics=True) as stack:
        yield stack
