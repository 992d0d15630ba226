"""No Triton behind the gateway: 503 PROVISIONING, which the real sie-sdk raises as ProvisioningError or,
under `wait_for_capacity`, retries until a tritonserver comes up (docs/contract.md, "Capacity and routing errors")."""

from __future__ import annotations

import json
import os
import subprocess
import time

import httpx

from devstack.net import free_port, wait_http
from devstack.serve import start_gateway, stop
from devstack.triton import REPO_ROOT, TritonPorts, start_triton, wait_ready
from tests.e2e.conftest import STUB
from tests.e2e.test_sie_sdk import DRIVER, sdk_python  # noqa: F401 - the fixture

STUB_CANONICAL = "sie-test/stub-tokens"
ENV = {**os.environ, "NO_PROXY": "127.0.0.1,localhost", "no_proxy": "127.0.0.1,localhost"}


def _driver(python, scenario: str, url: str) -> subprocess.Popen:
    return subprocess.Popen([str(python), str(DRIVER), scenario, url, STUB_CANONICAL], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env=ENV)


def _result(proc: subprocess.Popen, timeout: float) -> dict:
    out, err = proc.communicate(timeout=timeout)
    assert proc.returncode == 0, err[-3000:]
    return json.loads(out.strip().splitlines()[-1])


def test_sdk_gets_provisioning_then_waits_for_capacity(sdk_python, tmp_path):  # noqa: F811
    ports = TritonPorts(free_port(), free_port(), free_port())
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    gateway = start_gateway(ports.grpc, port, workers=1, log_path=tmp_path / "gateway.log", extra_env={
        "SIE_AUTH_MODE": "none", "SIE_GATEWAY_MODEL_REFRESH_S": "1",
        # the contract's 60 s would make this test wait a minute per retry
        "SIE_GATEWAY_PROVISIONING_RETRY_AFTER_S": "1"})
    triton = None
    try:
        wait_http(url + "/healthz")
        raw = httpx.post(f"{url}/v1/generate/{STUB}", json={"prompt": "hi", "max_new_tokens": 2}, timeout=30)
        assert raw.status_code == 503
        assert raw.json()["error"]["code"] == "PROVISIONING"
        assert raw.headers["x-sie-error-code"] == "PROVISIONING" and raw.headers["retry-after"] == "1"
        assert raw.headers["x-sie-version"] == raw.headers["x-sie-server-version"]

        refused = _result(_driver(sdk_python, "provisioning_no_wait", url), 120)
        assert refused["ok"] is False and refused["error"]["class"] == "ProvisioningError", refused

        waiting = _driver(sdk_python, "wait_for_capacity", url)
        time.sleep(3)  # the SDK has been answered PROVISIONING and is retrying
        assert waiting.poll() is None, "the SDK gave up instead of waiting for capacity"
        triton = start_triton(REPO_ROOT / "tests" / "stub_repository", ports, tmp_path / "triton.log")
        wait_ready(ports, triton, timeout=120)
        done = _result(waiting, 120)
        assert done["ok"] is True, done
        assert done["retries"] >= 2 and done["result"]["text"]
    finally:
        stop(gateway)
        stop(triton)
