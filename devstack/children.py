"""Starting the stack's servers (tritonserver, the gateway's gunicorn) so that they die with their starter.

Each server runs in a session of its own, so that `devstack.serve.stop` can signal its whole process group
(Triton's Python-backend stubs, gunicorn's workers). That also puts it out of reach of whatever ends the starter:
a terminal's Ctrl-C goes to the starter's group only, and a starter killed with SIGKILL runs no cleanup at all.
Without more, `make serve` killed that way leaves tritonserver and gunicorn running, holding their ports and the
model's memory. On Linux each server therefore asks the kernel for a signal when its parent dies
(`PR_SET_PDEATHSIG`, set in the child between fork and exec).

The signal is SIGTERM, the servers' own graceful stop: tritonserver unloads its models (their stubs exit with it)
within its `--exit-timeout-secs`, and gunicorn's master stops its workers. SIGKILL would end the leader alone and
leave those grandchildren behind (gunicorn's uvicorn workers do not watch their parent).
"""

from __future__ import annotations

import ctypes
import os
import signal
import subprocess
import sys
import threading
from collections.abc import Callable
from typing import Any

_PR_SET_PDEATHSIG = 1  # <linux/prctl.h>


def _death_signal_setter(sig: int) -> Callable[[], None]:
    """A preexec_fn that asks for `sig` when the parent dies.

    libc is looked up here, in the parent: the child between fork and exec should do as little as it can."""
    prctl = ctypes.CDLL(None, use_errno=True).prctl
    parent = os.getpid()

    def set_death_signal() -> None:
        if prctl(_PR_SET_PDEATHSIG, sig, 0, 0, 0) != 0:
            err = ctypes.get_errno()
            raise OSError(err, f"prctl(PR_SET_PDEATHSIG): {os.strerror(err)}")
        if os.getppid() != parent:  # the parent died before the request took effect: no signal will come
            os._exit(1)

    return set_death_signal


def start_child(args: list[str], death_signal: int = signal.SIGTERM, **popen: Any) -> subprocess.Popen:
    """`subprocess.Popen(args, **popen)` in a session of its own, sent `death_signal` when this process dies
    (Linux; elsewhere it outlives a killed starter, as before).

    The kernel sends the signal when the *thread* that forked the child ends, not the process, so this must be
    called from the main thread: a server started from a worker thread would be stopped when that thread ends."""
    preexec = None
    if sys.platform.startswith("linux"):
        if threading.current_thread() is not threading.main_thread():
            raise RuntimeError("start_child must be called from the main thread: the child's death signal is tied "
                               "to the thread that starts it")
        preexec = _death_signal_setter(death_signal)
    return subprocess.Popen(args, start_new_session=True, preexec_fn=preexec, **popen)
