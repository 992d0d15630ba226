"""`make serve` killed outright (SIGKILL: no handler runs, no cleanup) takes its whole stack with it.

Its tritonserver and gunicorn each run in a session of their own, so only the parent-death signal they ask for at
start (devstack.children) can reach them: without it they kept running, holding their ports and the model."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from devstack.net import free_port, wait_http
from devstack.triton import REPO_ROOT
from tests.helpers.processes import children, group_members, running
from tests.helpers.waiting import poll, wait_until

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="the parent-death signal is Linux's")


def _kill_all(pids: list[int]) -> None:
    for pid in pids:
        if running(pid):
            os.kill(pid, signal.SIGKILL)


def test_a_sigkilled_serve_leaves_no_server_running(tmp_path: Path) -> None:
    triton_http, gateway_port = free_port(), free_port()
    env = {**os.environ, "MODEL_REPOSITORY": str(REPO_ROOT / "tests" / "stub_repository"),
           "TRITON_HTTP_PORT": str(triton_http), "TRITON_GRPC_PORT": str(free_port()),
           "TRITON_METRICS_PORT": str(free_port()), "GATEWAY_PORT": str(gateway_port), "GATEWAY_WORKERS": "1",
           "SIE_AUTH_MODE": "none"}
    env.pop("MODEL", None)
    with open(tmp_path / "serve.log", "wb") as log:
        serve = subprocess.Popen([sys.executable, "-m", "devstack.serve"], cwd=REPO_ROOT, env=env, stdout=log,
                                 stderr=subprocess.STDOUT)
    stack: list[int] = []
    try:
        wait_http(f"http://127.0.0.1:{gateway_port}/readyz", timeout=120)
        servers = children(serve.pid)  # tritonserver and gunicorn, each leading its own group
        assert len(servers) == 2, (tmp_path / "serve.log").read_text()[-2000:]
        # with their own children: the Python-backend stubs, the gateway's worker
        stack = [pid for leader in servers for pid in group_members(leader)]
        assert len(stack) >= 4, stack
        serve.kill()
        serve.wait()
        left = poll(lambda: [pid for pid in stack if running(pid)], 30, until=lambda alive: not alive)
        assert not left, f"still running after serve was SIGKILLed: {left}"
        wait_until(lambda: _port_free(triton_http) and _port_free(gateway_port), 5, "a server's port is still held")
    finally:
        serve.kill()
        serve.wait()
        _kill_all(stack)


def _port_free(port: int) -> bool:
    """No listener on `port` (SO_REUSEADDR: the served request's TIME_WAIT does not count)."""
    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
        return True
