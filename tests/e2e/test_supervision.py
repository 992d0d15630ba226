"""A model process killed on the real stack (kill -9; an OOM kill or a segfault ends it the same way): found within
seconds, its requests ended in-band, out of service while the gateway reloads it through Triton's repository API, then
back by itself.

The kill is `kill -9` of the SmolLM2 `triton_python_backend_stub`, a child of a tritonserver this test starts for
itself. The engine's own fatal path (`_die()`: the stub exits) ends the same way.

The stack is the test's own, serving SmolLM2 alone, because tritonserver 2.51 itself sometimes aborts when a stub
dies inside a shared-memory critical section (`boost::interprocess::lock_exception` in libtriton_python.so;
triton-inference-server/server#8882 and #5949). On the shared session stack that took every later e2e test down
with it. That abort is Triton's, not ours: when the log shows it, the scenario runs once more on a fresh stack.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import time
import warnings
from collections.abc import Callable, Iterator
from pathlib import Path

import httpx

from devstack.stack import local_stack
from tests.e2e.conftest import MODEL, Stack
from tests.helpers.repository import SMOLLM2 as TRITON_MODEL
from tests.helpers.repository import smollm2_only
from tests.helpers.sse import data_payloads

DETECT_WITHIN_S = 10.0  # probe every 2 s + the backend's 1 s answer, with room for a loaded box
RECOVER_WITHIN_S = 180.0


def _stub_pid(stack: Stack, model: str) -> int | None:
    """The model's stub process among this test's tritonserver's children (from /proc: no truncated `ps`)."""
    for proc in Path("/proc").iterdir():
        try:
            ppid = int((proc / "stat").read_text().rsplit(")", 1)[1].split()[1])
            args = (proc / "cmdline").read_bytes().split(b"\0")
        except (OSError, ValueError, IndexError):
            continue
        if ppid == stack.triton_pid and args[0].endswith(b"triton_python_backend_stub") and \
                len(args) > 1 and f"/{model}/".encode() in args[1]:
            return int(proc.name)
    return None


def _chat(stack: Stack, **extra) -> httpx.Response:
    return httpx.post(f"{stack.base_url}/v1/chat/completions", timeout=60, json={
        "model": MODEL, "max_tokens": 3, "messages": [{"role": "user", "content": "Hi"}], **extra})


def _served(stack: Stack) -> bool:
    models = httpx.get(f"{stack.base_url}/v1/models", timeout=10).json()["data"]
    return any(m["id"] == MODEL for m in models)


UPSTREAM_ABORT = "boost::interprocess::lock_exception"


@contextlib.contextmanager
def _smollm2_stack(log_dir: Path) -> Iterator[tuple[Stack, Callable[[], bool]]]:
    """A stack of its own on a repository holding only SmolLM2; also says whether its tritonserver hit the upstream
    abort."""
    repo = smollm2_only(log_dir)
    env = {"SIE_AUTH_MODE": "none", "SIE_RESPONSES_STORE": str(log_dir / "responses.sqlite3")}
    with local_stack(repo, log_dir, extra_env=env) as running:
        def triton_aborted() -> bool:
            log = (log_dir / "triton.log").read_text(errors="replace")
            return running.triton.poll() is not None and UPSTREAM_ABORT in log

        yield Stack(running.base_url, running.triton_ports, log_dir, running.triton.pid), triton_aborted


def test_a_killed_model_process_is_detected_ended_in_band_and_reloaded(tmp_path: Path):
    for attempt in (1, 2):
        log_dir = tmp_path / f"attempt-{attempt}"
        log_dir.mkdir()
        with _smollm2_stack(log_dir) as (stack, triton_aborted):
            try:
                _kill_the_stub_and_watch_it_come_back(stack)
                return
            except AssertionError:
                if attempt == 2 or not triton_aborted():
                    raise
                warnings.warn(f"tritonserver aborted with {UPSTREAM_ABORT} when its stub was killed (an upstream "
                              "bug); running the scenario again on a fresh stack", stacklevel=1)


def _kill_the_stub_and_watch_it_come_back(stack: Stack) -> None:
    assert _chat(stack).status_code == 200
    victim = _stub_pid(stack, TRITON_MODEL)
    assert victim is not None, "no SmolLM2 stub process under this test's tritonserver"
    events: list[str] = []
    with httpx.stream("POST", f"{stack.base_url}/v1/chat/completions", timeout=120, json={
            "model": MODEL, "max_tokens": 1500, "stream": True, "temperature": 0.8,
            "messages": [{"role": "user", "content": "Tell me a very long story."}]}) as stream:
        assert stream.status_code == 200
        payloads = data_payloads(stream.iter_lines())
        for payload in payloads:
            events.append(payload)
            if len(events) == 5:
                break
        os.kill(victim, signal.SIGKILL)
        killed = time.monotonic()
        events.extend(payloads)
        stream_ended = time.monotonic() - killed
    # the stream ends with an error event and [DONE], within seconds (it sat silent until the 60 s inter-chunk
    # timeout before)
    assert events[-1] == "[DONE]"
    error = json.loads(events[-2])["error"]
    assert error["code"] == "MODEL_LOADING", error
    assert stream_ended < DETECT_WITHIN_S, f"the stream ended {stream_ended:.1f} s after the kill"

    # out of service while it reloads: 503 with Retry-After, and not listed. Each gateway worker finds the death
    # on its own (the one that served the stream at once, the other by its next probe) and a request may land on
    # either, so the listing is polled until one answers without the model.
    blocking = _chat(stack)
    assert blocking.status_code == 503 and blocking.headers["retry-after"] == "5", blocking.text
    assert blocking.json()["error"]["code"] == "MODEL_LOADING"
    while _served(stack):
        assert time.monotonic() - killed < DETECT_WITHIN_S, "still listed in /v1/models while it reloads"
        time.sleep(0.2)

    # back by itself, on a new process
    recovered = None
    while time.monotonic() - killed < RECOVER_WITHIN_S:
        if _chat(stack).status_code == 200:
            recovered = time.monotonic() - killed
            break
        time.sleep(0.5)
    assert recovered is not None, f"not serving {RECOVER_WITHIN_S} s after the kill"
    print(f"stream ended {stream_ended:.1f} s after the kill; serving again after {recovered:.1f} s")
    assert _stub_pid(stack, TRITON_MODEL) not in (None, victim)
    # on every worker: the one that answered found the new process first; the other does by its next probe (2 s)
    back_everywhere = time.monotonic() + DETECT_WITHIN_S
    while not all(_chat(stack).status_code == 200 for _ in range(4)):
        assert time.monotonic() < back_everywhere, "a gateway worker still refuses the reloaded model"
        time.sleep(0.5)
    assert _served(stack) and _served(stack)
    assert httpx.get(f"{stack.base_url}/readyz", timeout=10).status_code == 200
    log = (stack.log_dir / "gateway.log").read_text(errors="replace")
    assert f"model {TRITON_MODEL} on endpoint local: its model process is dead" in log
    assert f"model {TRITON_MODEL} on endpoint local is serving again" in log
