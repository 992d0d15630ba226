"""Polling for a state another thread, process or server reaches on its own time.

`poll` never fails: the caller asserts what it needs on the value it gets back (so a test keeps its own, often
stricter, check). `wait_until` fails the test with `message` when the time runs out first.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from typing import TypeVar

T = TypeVar("T")


def poll(read: Callable[[], T], timeout_s: float, *, until: Callable[[T], object] = bool,
         interval_s: float = 0.1) -> T:
    """Call `read` every `interval_s` until `until(value)` holds or `timeout_s` has passed; the last value read."""
    deadline = time.monotonic() + timeout_s
    value = read()
    while not until(value) and time.monotonic() < deadline:
        time.sleep(interval_s)
        value = read()
    return value


def wait_until(read: Callable[[], T], timeout_s: float, message: str, *, until: Callable[[T], object] = bool,
               interval_s: float = 0.1) -> T:
    """`poll`, failing the test with `message` unless `until(value)` held within `timeout_s`."""
    value = poll(read, timeout_s, until=until, interval_s=interval_s)
    assert until(value), message
    return value


async def wait_until_async(predicate: Callable[[], object], timeout_s: float, message: str,
                           interval_s: float = 0.02) -> None:
    """`wait_until` for a test on the event loop: sleeps without blocking the app it is waiting on."""
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline, message
        await asyncio.sleep(interval_s)
