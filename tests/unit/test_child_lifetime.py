"""A child started by devstack (in a session of its own, out of reach of its starter's group) still dies when its
starter is killed outright, so nothing holds the stack's ports and memory after a SIGKILLed `make serve`."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
from pathlib import Path

import pytest

from devstack.children import start_child
from tests.helpers.processes import running
from tests.helpers.waiting import poll

REPO = Path(__file__).resolve().parents[2]
# the starter: one child through devstack's helper, its pid on stdout, then it waits to be killed
STARTER = """
import sys, time
from devstack.children import start_child
child = start_child([sys.executable, "-c", "import time; time.sleep(60)"])
print(child.pid, flush=True)
time.sleep(60)
"""

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="the parent-death signal is Linux's")


def test_a_child_dies_with_its_starter_killed_by_sigkill() -> None:
    starter = subprocess.Popen([sys.executable, "-c", STARTER], cwd=REPO, stdout=subprocess.PIPE, text=True)
    child = int(starter.stdout.readline())  # type: ignore[union-attr]
    try:
        assert running(child)
        assert os.getpgid(child) == child  # its own group: the starter's group signals do not reach it
        starter.kill()
        starter.wait()
        assert not poll(lambda: running(child), 5, until=lambda alive: not alive), \
            "the child outlived its SIGKILLed starter"
    finally:
        starter.kill()
        starter.wait()
        if running(child):
            os.kill(child, signal.SIGKILL)


def test_a_child_is_not_started_from_a_worker_thread() -> None:
    """The death signal follows the thread that forked: from a worker thread the server would stop when that
    thread ends, so the helper refuses."""
    errors: list[BaseException] = []

    def start() -> None:
        try:
            start_child([sys.executable, "-c", "pass"]).wait()
        except RuntimeError as exc:
            errors.append(exc)

    thread = threading.Thread(target=start)
    thread.start()
    thread.join()
    assert errors and "main thread" in str(errors[0])
