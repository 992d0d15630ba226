"""A long Triton outage: every gateway worker serves again within seconds of Triton being ready.

gRPC's default reconnect backoff grows 1 s x 1.6 per failed attempt (with 20 % jitter) up to 120 s: its attempts fall
near 0, 1, 2.5, 5, 9, 15, 25, 44 and 70 s into an outage (measured). Triton is back about 32 s in, between the attempts
near 25 s and 44 s, so with that backoff a worker keeps failing for many seconds more (measured with a 51 s outage,
between the attempts near 44 s and 70 s: still failing 7.4 s after ready, where the probing stops; a 101 s outage once
left workers failing 19 s and 56 s after it). Triton must be back well after the attempt near 25 s for the test to
fail on that backoff, whatever the jitter. With the gateway's bounded backoff (2 s) it is back within about 2 s.
"""

from __future__ import annotations

import concurrent.futures
import time

import httpx

from devstack.net import free_port, wait_http
from devstack.serve import start_gateway, stop
from devstack.triton import REPO_ROOT, TritonPorts, start_triton, wait_ready
from tests.e2e.conftest import STUB

DOWN_S = 28  # plus the restart (about 4 s): Triton is ready again about 32 s after it died
SERVE_WITHIN_S = 5.0
PROBE_FOR_S = 8.0


def _probe(url: str) -> bool:
    """One request on a fresh connection (it lands on whichever worker accepts it)."""
    try:
        r = httpx.post(f"{url}/v1/generate/{STUB}", json={"prompt": "hi", "max_new_tokens": 2}, timeout=5)
    except httpx.HTTPError:
        return False
    return r.status_code == 200


def test_every_worker_serves_within_seconds_of_triton_after_a_long_outage(tmp_path):
    ports = TritonPorts(free_port(), free_port(), free_port())
    repo = REPO_ROOT / "tests" / "stub_repository"
    triton = start_triton(repo, ports, tmp_path / "triton.log")
    gateway = None
    try:
        wait_ready(ports, triton, timeout=120)
        port = free_port()
        # the default model refresh (5 s), two workers: each holds its own channel and its own backoff
        gateway = start_gateway(ports.grpc, port, workers=2, log_path=tmp_path / "gateway.log")
        url = f"http://127.0.0.1:{port}"
        wait_http(url + "/readyz")
        with concurrent.futures.ThreadPoolExecutor(8) as pool:
            assert all(pool.map(_probe, [url] * 8))
            triton.kill()  # SIGKILL: its model stubs follow it (same process group)
            stop(triton)
            died = time.monotonic()
            deadline = died + DOWN_S
            while time.monotonic() < deadline:  # traffic all along: both workers keep failing and backing off
                list(pool.map(_probe, [url] * 4))
                time.sleep(1.0)
            triton = start_triton(repo, ports, tmp_path / "triton.log")
            wait_ready(ports, triton, timeout=120)
            ready = time.monotonic()
            failures: list[float] = []
            while time.monotonic() < ready + PROBE_FOR_S:
                # 8 at once, each on its own connection: both workers accept some of every round
                sent = time.monotonic()
                for ok in pool.map(_probe, [url] * 8):
                    if not ok:
                        failures.append(sent - ready)
                time.sleep(0.25)
        last_failure = max(failures, default=0.0)
        print(f"Triton ready {ready - died:.1f} s after it died; {len(failures)} requests failed after, the last "
              f"{last_failure:.1f} s after ready")
        assert last_failure < SERVE_WITHIN_S, f"a worker still failed {last_failure:.1f} s after Triton was ready"
    finally:
        stop(gateway)
        stop(triton)
