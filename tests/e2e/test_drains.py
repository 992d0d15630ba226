"""Rolling restarts that lose nothing, on real processes: SIGTERM to the gateway (gunicorn), and SIGTERM to one of
two tritonservers while streams run on both. The stub model (no torch) is paced by SIE_STUB_TOKEN_DELAY_S and
each server's tokens carry its own text, so a stream's text says which server produced it."""

from __future__ import annotations

import re
import signal
import socket
import subprocess
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace

import httpx
import orjson
import pytest

from devstack.net import free_port, wait_http
from devstack.serve import start_gateway, stop
from devstack.triton import REPO_ROOT, TritonPorts, start_triton, wait_ready
from gateway.router import _rendezvous_score
from tests.e2e.conftest import STUB
from tests.helpers.sse import DONE, data_payloads
from tests.helpers.waiting import wait_until

TOKEN_DELAY_S = 0.05
GENERATE = f"/v1/generate/{STUB}"


@dataclass
class Outcome:
    status: int
    text: str
    dones: int
    error: str | None
    first_at: float  # monotonic time of the first data event
    ended_at: float


def _stream(base_url: str, max_tokens: int, first: threading.Event | None = None, key: str | None = None
            ) -> Outcome:
    text, dones, error, first_at = [], 0, None, 0.0
    body = {"prompt": "x", "max_new_tokens": max_tokens, "stream": True, **({"routing_key": key} if key else {})}
    with httpx.stream("POST", base_url + GENERATE, json=body, timeout=60) as resp:
        if resp.status_code != 200:
            resp.read()
            return Outcome(resp.status_code, resp.text, 0, None, 0.0, time.monotonic())
        for payload in data_payloads(resp.iter_lines()):
            if not first_at:
                first_at = time.monotonic()
                if first is not None:
                    first.set()
            if payload == DONE:
                dones += 1
                continue
            event = orjson.loads(payload)
            text.append(event.get("text_delta", ""))
            if event.get("error"):
                error = event["error"]["code"]
    return Outcome(200, "".join(text), dones, error, first_at, time.monotonic())


def _triton(tmp_path: Path, name: str, token: str) -> tuple[subprocess.Popen, TritonPorts]:
    ports = TritonPorts(free_port(), free_port(), free_port())
    proc = start_triton(REPO_ROOT / "tests" / "stub_repository", ports, tmp_path / f"triton-{name}.log",
                        extra_env={"SIE_STUB_TOKEN_DELAY_S": str(TOKEN_DELAY_S), "SIE_STUB_TOKEN_TEXT": token})
    return proc, ports


def _key_preferring(url: str, other: str) -> str:
    """A routing key whose rendezvous first choice is `url`."""
    def score(key: str, u: str) -> int:
        return _rendezvous_score(key, SimpleNamespace(config=SimpleNamespace(url=u)))  # type: ignore[arg-type]

    return next(k for k in (f"key-{i}" for i in range(1000)) if score(k, url) > score(k, other))


def _refused_or_503(url: str) -> bool:
    try:
        return httpx.get(url, timeout=1).status_code == 503
    except httpx.TransportError:
        return True


@pytest.fixture
def slow_triton(tmp_path):
    proc, ports = _triton(tmp_path, "a", "tok ")
    try:
        wait_ready(ports, proc, timeout=120)
        yield ports
    finally:
        stop(proc)


def test_sigterm_to_the_gateway_drains_then_ends_what_is_left_in_band_and_exits_0(slow_triton, tmp_path):
    graceful_s = 4  # drain deadline at 3 s (gateway/drain.py)
    port = free_port()
    base = f"http://127.0.0.1:{port}"
    gateway = start_gateway(slow_triton.grpc, port, workers=2, log_path=tmp_path / "gateway.log",
                            extra_env={"SIE_AUTH_MODE": "none", "GATEWAY_GRACEFUL_TIMEOUT": str(graceful_s)})
    try:
        wait_http(base + "/readyz")
        short, long_ = 20, 400  # 1 s of tokens, and 20 s: past the deadline
        started = [threading.Event() for _ in range(8)]
        with ThreadPoolExecutor(8) as pool:
            futures = [pool.submit(_stream, base, short if i < 6 else long_, started[i]) for i in range(8)]
            assert all(e.wait(30) for e in started)
            term_at = time.monotonic()
            gateway.send_signal(signal.SIGTERM)  # the master only, as Kubernetes signals PID 1
            while not _refused_or_503(base + "/readyz"):
                assert time.monotonic() - term_at < 2, "readiness still passes 2 s after SIGTERM"
                time.sleep(0.02)
            not_ready_s = time.monotonic() - term_at
            with pytest.raises(httpx.TransportError):  # no new connection is taken
                httpx.post(base + GENERATE, json={"prompt": "x", "max_new_tokens": 1}, timeout=2)
            outcomes = [f.result(timeout=30) for f in futures]
        code = gateway.wait(timeout=graceful_s + 5)
        exit_s = time.monotonic() - term_at
    finally:
        stop(gateway)
    assert code == 0
    for outcome in outcomes[:6]:  # finished within the grace: whole
        assert (outcome.status, outcome.error, outcome.dones) == (200, None, 1)
        assert outcome.text == "tok " * short
    for outcome in outcomes[6:]:  # still open at the deadline: ended in-band, not cut
        assert (outcome.status, outcome.error, outcome.dones) == (200, "server_shutting_down", 1)
        assert 0 < outcome.text.count("tok ") < long_
        assert graceful_s - 1.5 < outcome.ended_at - term_at < graceful_s
    assert exit_s < graceful_s + 1
    print(f"\ngateway drain: readiness failed {not_ready_s * 1000:.0f} ms after SIGTERM; 6/6 streams that fit in "
          f"the grace finished whole, 2/2 longer ones ended with server_shutting_down + [DONE] at "
          f"{max(o.ended_at for o in outcomes[6:]) - term_at:.2f} s; exit {code} after {exit_s:.2f} s")


def test_no_connection_is_taken_after_sigterm_even_while_a_worker_has_not_seen_it(tmp_path):
    """The workers share one listening socket, and the kernel completes handshakes while any process holds it.
    With one worker stopped (busy, or not scheduled yet on a loaded box) the other's close alone left the
    socket open; the master now shuts it for all of them before signalling any (docker/gunicorn.conf.py)."""
    import psutil

    port = free_port()
    gateway = start_gateway(free_port(), port, workers=2, log_path=tmp_path / "gateway.log",
                            extra_env={"SIE_AUTH_MODE": "none", "GATEWAY_GRACEFUL_TIMEOUT": "3"})
    late = None
    try:
        wait_http(f"http://127.0.0.1:{port}/healthz")
        wait_until(lambda: (tmp_path / "gateway.log").read_text().count("Application startup complete") >= 2, 60,
                   "two workers never started")
        late = psutil.Process(gateway.pid).children()[1]
        late.suspend()  # this worker will not act on its SIGTERM until resumed
        gateway.send_signal(signal.SIGTERM)
        time.sleep(1.0)  # the master has shut the listener and signalled both; the other worker has closed its copy
        with pytest.raises(ConnectionRefusedError):
            socket.create_connection(("127.0.0.1", port), timeout=2).close()
    finally:
        if late is not None:
            late.resume()
        code = gateway.wait(timeout=15) if gateway.poll() is None else gateway.returncode
        stop(gateway)
    assert code == 0


def test_sigterm_to_one_of_two_tritons_loses_no_stream_and_no_request(tmp_path):
    (a, a_ports), (b, b_ports) = _triton(tmp_path, "a", "a "), _triton(tmp_path, "b", "b ")
    routing = tmp_path / "routing.yaml"
    routing.write_text(f"pools:\n  default:\n    endpoints:\n      - {{url: '127.0.0.1:{a_ports.grpc}', name: a}}\n"
                       f"      - {{url: '127.0.0.1:{b_ports.grpc}', name: b}}\n")
    port = free_port()
    base = f"http://127.0.0.1:{port}"
    gateway = None
    try:
        wait_ready(a_ports, a, timeout=120)
        wait_ready(b_ports, b, timeout=120)
        # a refresh period longer than the test: the gateway learns that A drains from the requests themselves
        gateway = start_gateway(a_ports.grpc, port, workers=1, log_path=tmp_path / "gateway.log", extra_env={
            "SIE_AUTH_MODE": "none", "SIE_GATEWAY_CONFIG": str(routing), "SIE_GATEWAY_MODEL_REFRESH_S": "60"})
        wait_http(base + "/readyz")
        tokens = 40  # 2 s a stream
        started = [threading.Event() for _ in range(32)]
        with ThreadPoolExecutor(40) as pool:
            streams = [pool.submit(_stream, base, tokens, started[i], f"user-{i}") for i in range(32)]
            assert all(e.wait(30) for e in started)
            term_at = time.monotonic()
            a.send_signal(signal.SIGTERM)
            while not _refused_or_503(f"http://127.0.0.1:{a_ports.http}/v2/health/ready"):
                time.sleep(0.01)
            not_ready_s = time.monotonic() - term_at
            # new requests from the moment A is not ready, half of them with a key whose first choice is A:
            # each must land on B; the first to try A fails over before its first token
            to_a = _key_preferring(f"127.0.0.1:{a_ports.grpc}", f"127.0.0.1:{b_ports.grpc}")
            later = []
            for i in range(20):
                later.append(pool.submit(_stream, base, 5, None, to_a if i % 2 == 0 else None))
                time.sleep(0.1)
            outcomes = [f.result(timeout=60) for f in streams]
            late = [f.result(timeout=60) for f in later]
        a_code = a.wait(timeout=30)
        a_exit_s = time.monotonic() - term_at
    finally:
        stop(gateway)
        stop(a)
        stop(b)
    served = {o.text[:2] for o in outcomes}
    assert served == {"a ", "b "}, served  # the streams ran on both servers
    for outcome in outcomes:
        assert (outcome.status, outcome.error, outcome.dones) == (200, None, 1), outcome
        assert outcome.text in ("a " * tokens, "b " * tokens)
    on_a = sum(o.text.startswith("a ") for o in outcomes)
    for outcome in late:
        assert (outcome.status, outcome.error, outcome.dones, outcome.text) == (200, None, 1, "b " * 5), outcome
    failovers = len(re.findall("failed before the first token; trying another",
                               (tmp_path / "gateway.log").read_text()))
    assert failovers >= 1
    assert a_code == 0
    print(f"\ntriton drain: A not ready {not_ready_s * 1000:.0f} ms after SIGTERM; 32/32 streams whole with one "
          f"[DONE] ({on_a} on A, {32 - on_a} on B); 20/20 later requests served by B, {failovers} of them failed "
          f"over from A before their first token; no 5xx; A exited {a_code} after {a_exit_s:.2f} s")



def test_sigterm_closes_status_watchers_and_the_gateway_still_exits_on_time(slow_triton, tmp_path):
    """An open /ws/cluster-status feed never ends by itself: SIGTERM must close it (uvicorn's 1012, service restart)
    rather than hold the worker until gunicorn kills it."""
    from websockets.exceptions import ConnectionClosed
    from websockets.sync.client import connect

    graceful_s = 4
    port = free_port()
    gateway = start_gateway(slow_triton.grpc, port, workers=1, log_path=tmp_path / "gateway.log",
                            extra_env={"SIE_AUTH_MODE": "none", "GATEWAY_GRACEFUL_TIMEOUT": str(graceful_s)})
    try:
        wait_http(f"http://127.0.0.1:{port}/readyz")
        with connect(f"ws://127.0.0.1:{port}/ws/cluster-status", open_timeout=10) as ws:
            assert orjson.loads(ws.recv(timeout=10))["type"] == "gateway"
            term_at = time.monotonic()
            gateway.send_signal(signal.SIGTERM)
            with pytest.raises(ConnectionClosed) as closed:
                while True:
                    ws.recv(timeout=graceful_s + 2)
            closed_s = time.monotonic() - term_at
        code = gateway.wait(timeout=graceful_s + 5)
        exit_s = time.monotonic() - term_at
    finally:
        stop(gateway)
    assert closed.value.rcvd is not None and closed.value.rcvd.code == 1012
    assert closed_s < 2 and code == 0 and exit_s < graceful_s
