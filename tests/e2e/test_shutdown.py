"""A tritonserver serving our engine stops cleanly on SIGTERM: no segfault in the model process at interpreter
finalisation (the engine's custom metrics used to outlive the backend's shared memory), and
exit 0 well within the exit timeout.

Runs the real engine glue on the tiny test VLM alone (the smallest model we serve: seconds to load)."""

from __future__ import annotations

import shutil
import signal
import time
import urllib.request

import httpx

from devstack.net import free_port
from devstack.serve import stop
from devstack.triton import REPO_ROOT, TritonPorts, start_triton, wait_ready
from tests.tiny_vlm import ensure_tiny_vlm

CRASH_MARKS = ("Segfault encountered", "Signal (11)", "Signal (6)", "Aborted", "core dumped")


def test_sigterm_stops_triton_with_no_crash_and_exit_0(tmp_path):
    assert ensure_tiny_vlm() is not None, "the tiny VLM needs the SmolLM2 tokenizer (make model)"
    repo = tmp_path / "repository"
    shutil.copytree(REPO_ROOT / "model_repository" / "tiny_vlm", repo / "tiny_vlm")
    ports = TritonPorts(free_port(), free_port(), free_port())
    log = tmp_path / "triton.log"
    proc = start_triton(repo, ports, log)
    try:
        wait_ready(ports, proc, timeout=240)
        reply = httpx.post(f"http://127.0.0.1:{ports.http}/v2/models/tiny_vlm/generate", timeout=60, json={
            "text_input": "hello", "sampling_parameters": '{"max_tokens": 4}'})
        assert reply.status_code == 200, reply.text
        time.sleep(1.0)  # the metrics thread has exported at least once
        metrics = urllib.request.urlopen(f"http://127.0.0.1:{ports.metrics}/metrics", timeout=5).read().decode()
        assert 'sie_engine_generation_tokens_total{model="tiny_vlm"}' in metrics
        started = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        code = proc.wait(timeout=60)
        stop_s = time.monotonic() - started
    finally:
        stop(proc)
    text = log.read_text(errors="replace")
    shutdown = text[text.find("Signal (15) received"):]
    crashes = [mark for mark in CRASH_MARKS if mark in shutdown]
    assert not crashes, shutdown[-4000:]
    assert "Exit timeout expired" not in shutdown, shutdown[-2000:]
    assert code == 0, shutdown[-2000:]
    print(f"\ntriton (tiny_vlm) stopped in {stop_s:.2f} s, exit {code}, no crash in the shutdown log")
