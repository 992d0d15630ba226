"""Routing across two real tritonserver processes behind one gateway.

Two Tritons serve the same model repository; the gateway's pool `default` lists both. Which Triton
served a request is read from each Triton's own metrics (the engine's finished-requests counter for the
model), so the test observes real placement, not the gateway's opinion of it. Triton's own
`nv_inference_request_success` also counts the gateway's liveness probes (gateway/supervisor.py), so it cannot.
"""

from __future__ import annotations

import os
import signal
import subprocess
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest

from devstack.net import free_port, wait_http
from devstack.serve import start_gateway, stop
from devstack.triton import REPO_ROOT, TritonPorts, start_triton, wait_ready
from tests.e2e.conftest import MODEL, SIE_MODEL
from tests.helpers.prometheus import metric_value, scrape
from tests.helpers.waiting import poll

TRITON_MODEL = "smollm2_135m_instruct"
METRIC = "sie_engine_request_success_total"  # by finish reason; exported every 0.5 s


@dataclass
class TritonNode:
    name: str
    ports: TritonPorts
    proc: subprocess.Popen

    def served(self) -> float:
        """Successful inferences of the model on this Triton so far."""
        return metric_value(scrape(f"http://127.0.0.1:{self.ports.metrics}/metrics", timeout=5), METRIC,
                            model=TRITON_MODEL)


@dataclass
class TwoTritons:
    base_url: str
    nodes: list[TritonNode]
    gateway: subprocess.Popen

    def counts(self) -> dict[str, float]:
        return {n.name: n.served() for n in self.nodes if n.proc.poll() is None}


@pytest.fixture(scope="module")
def two_tritons(tmp_path_factory) -> Iterator[TwoTritons]:
    tmp = tmp_path_factory.mktemp("two-tritons")
    repo = REPO_ROOT / "model_repository"
    nodes: list[TritonNode] = []
    gateway = None
    try:
        for name in ("triton-a", "triton-b"):
            ports = TritonPorts(free_port(), free_port(), free_port())
            nodes.append(TritonNode(name, ports, start_triton(repo, ports, tmp / f"{name}.log")))
        for node in nodes:
            wait_ready(node.ports, node.proc, timeout=300)
        config = tmp / "gateway.yaml"
        lines = ["pools:", "  default:", "    machine_profile: default", "    endpoints:"]
        for node in nodes:
            lines += [f"      - url: 127.0.0.1:{node.ports.grpc}", "        remote: false",
                      f"        name: {node.name}"]
        config.write_text("\n".join(lines) + "\n")
        port = free_port()
        gateway = start_gateway(nodes[0].ports.grpc, port, workers=2, log_path=tmp / "gateway.log", extra_env={
            "SIE_AUTH_MODE": "none", "SIE_GATEWAY_CONFIG": str(config), "SIE_GATEWAY_MODEL_REFRESH_S": "1",
        })
        base_url = f"http://127.0.0.1:{port}"
        wait_http(f"{base_url}/readyz")
        stack = TwoTritons(base_url, nodes, gateway)
        _wait_both_discovered(stack)
        yield stack
    finally:
        # in parallel, and not past Triton's own 10 s exit timeout: the survivor tends to sit it out
        with ThreadPoolExecutor(3) as pool:
            list(pool.map(lambda proc: stop(proc, timeout=12), [gateway, *(node.proc for node in nodes)]))
        if os.environ.get("CI"):
            for path in sorted(Path(tmp).glob("*.log")):
                print(f"--- tail of {path.name} ---\n" + path.read_text(errors="replace")[-3000:])


def _wait_both_discovered(stack: TwoTritons, timeout: float = 30.0) -> None:
    """Every gateway worker refreshes on its own; wait until spread-out requests reach both Tritons."""
    deadline = time.monotonic() + timeout
    before = stack.counts()
    i = 0
    while time.monotonic() < deadline:
        for _ in range(6):
            _generate(stack.base_url, routing_key=f"warmup-{i}")
            i += 1
        if all(after > before[name] for name, after in stack.counts().items()):
            return
    raise TimeoutError("the gateway never routed to both Tritons")


def _generate(base_url: str, routing_key: str | None = None, stream: bool = False) -> httpx.Response:
    body: dict = {"prompt": "The capital of France is", "max_new_tokens": 2, "temperature": 0}
    if routing_key is not None:
        body["routing_key"] = routing_key
    if stream:
        body["stream"] = True
    return httpx.post(f"{base_url}/v1/generate/{SIE_MODEL}", json=body, timeout=60)


def _chat(base_url: str, prompt_cache_key: str | None = None) -> httpx.Response:
    body: dict = {"model": MODEL, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2}
    if prompt_cache_key is not None:
        body["prompt_cache_key"] = prompt_cache_key
    return httpx.post(f"{base_url}/v1/chat/completions", json=body, timeout=60)


def _delta(before: dict[str, float], after: dict[str, float]) -> dict[str, float]:
    return {name: after[name] - before.get(name, 0.0) for name in after}


def _settled_counts(stack: TwoTritons) -> dict[str, float]:
    """The counts once the requests already answered have reached /metrics (one export period and more)."""
    time.sleep(1.0)
    return stack.counts()


def _served_since(stack: TwoTritons, before: dict[str, float], n: int) -> dict[str, float]:
    """Per Triton, the requests served since `before`, once all `n` show (the engine's counters reach /metrics
    on its next export, every 0.5 s)."""
    return poll(lambda: _delta(before, stack.counts()), 5, until=lambda delta: sum(delta.values()) >= n)


def _placement(stack: TwoTritons, send, n: int = 4) -> dict[str, float]:
    before = _settled_counts(stack)
    for _ in range(n):
        r = send()
        assert r.status_code == 200, r.text
    return _served_since(stack, before, n)


def test_same_routing_key_lands_on_one_triton(two_tritons):
    for key in ("user-alpha", "user-beta", "user-gamma"):
        delta = _placement(two_tritons, lambda key=key: _generate(two_tritons.base_url, routing_key=key))
        assert sorted(delta.values()) == [0, 4], (key, delta)


def test_same_routing_key_streaming_lands_on_one_triton(two_tritons):
    delta = _placement(two_tritons, lambda: _generate(two_tritons.base_url, routing_key="stream-key", stream=True))
    assert sorted(delta.values()) == [0, 4], delta


def test_same_prompt_cache_key_lands_on_one_triton(two_tritons):
    for key in ("cache-1", "cache-2"):
        delta = _placement(two_tritons, lambda key=key: _chat(two_tritons.base_url, prompt_cache_key=key))
        assert sorted(delta.values()) == [0, 4], (key, delta)


def test_different_keys_spread_across_both(two_tritons):
    before = _settled_counts(two_tritons)
    for i in range(8):
        assert _generate(two_tritons.base_url, routing_key=f"spread-{i}").status_code == 200
        assert _chat(two_tritons.base_url, prompt_cache_key=f"spread-chat-{i}").status_code == 200
    delta = _served_since(two_tritons, before, 16)
    assert sum(delta.values()) == 16
    assert all(v >= 2 for v in delta.values()), delta


def test_no_key_spreads_by_load(two_tritons):
    """Without a key: least outstanding requests, so concurrent requests use both Tritons."""
    before = _settled_counts(two_tritons)
    with ThreadPoolExecutor(8) as pool:
        statuses = list(pool.map(lambda _: _generate(two_tritons.base_url).status_code, range(16)))
    assert statuses == [200] * 16
    delta = _served_since(two_tritons, before, 16)
    assert all(v > 0 for v in delta.values()), delta


def test_killed_triton_traffic_moves_to_survivor(two_tritons):
    """Kill the Triton a key is pinned to: requests still succeed (retried before the first token)."""
    key = "pinned-then-killed"
    delta = _placement(two_tritons, lambda: _generate(two_tritons.base_url, routing_key=key), n=2)
    victim = next(n for n in two_tritons.nodes if delta[n.name] == 2)
    survivor = next(n for n in two_tritons.nodes if n is not victim)
    os.killpg(victim.proc.pid, signal.SIGKILL)
    victim.proc.wait(timeout=10)

    before = _settled_counts(two_tritons)[survivor.name]
    # straight away (the gateway still believes the victim healthy), then after its refresh noticed
    for round_ in range(2):
        for i in range(3):
            r = _generate(two_tritons.base_url, routing_key=key)
            assert r.status_code == 200, (round_, r.text)
            assert r.json()["text"]
            r = _chat(two_tritons.base_url, prompt_cache_key=key)
            assert r.status_code == 200, (round_, r.text)
            r = _generate(two_tritons.base_url, routing_key=f"other-{round_}-{i}", stream=True)
            assert r.status_code == 200 and "data: [DONE]" in r.text and '"error"' not in r.text, r.text
        time.sleep(2.5)
    assert survivor.served() - before == 18
    assert two_tritons.gateway.poll() is None  # the same gateway process, never restarted
    assert httpx.get(f"{two_tritons.base_url}/readyz", timeout=5).status_code == 200
