"""Request intake: the `cache_salt` input's check, and the slow lane, where what can take seconds runs off Triton's
one request thread.

Why: `execute()` runs on the stub's only request thread, so a 21 s grammar compile or the decode of sixteen large
images there delayed every request behind it. A request that needs either is prepared here
instead, on a few worker threads, and then submitted; a plain request is still prepared inline (tokenizing is
fast) and so never waits behind a slow one. The lane is bounded: past `limit` waiting preparations a request is
refused with QUEUE_FULL at once, like a full engine queue.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

from engine.errors import EngineError, QueueFull

log = logging.getLogger(__name__)

CACHE_SALT_MAX_CHARS = 256


def checked_cache_salt(value: str | None) -> str | None:
    """The `cache_salt` input (the tenant's prefix-cache scope; absent: the shared cache). Its value is never put in
    an error message or a log line: it identifies a tenant."""
    if value is None:
        return None
    if not 0 < len(value) <= CACHE_SALT_MAX_CHARS:
        raise EngineError("invalid_request", f"cache_salt must be 1 to {CACHE_SALT_MAX_CHARS} characters, "
                          f"got {len(value)}", "cache_salt")
    return value


class SlowLane:
    def __init__(self, workers: int = 4, limit: int = 64) -> None:
        self._pool = ThreadPoolExecutor(workers, thread_name_prefix="request-prepare")
        self._limit = limit
        self._waiting = 0
        self._lock = threading.Lock()

    def submit(self, admit: Callable[[], None], fail: Callable[[EngineError], None]) -> None:
        """Run `admit` (prepare and submit one request) on a worker; any error it raises goes to `fail`."""
        with self._lock:
            if self._waiting >= self._limit:
                raise QueueFull("too many requests are being prepared; retry later")
            self._waiting += 1
        self._pool.submit(self._run, admit, fail)

    def _run(self, admit: Callable[[], None], fail: Callable[[EngineError], None]) -> None:
        try:
            admit()
        except EngineError as exc:
            fail(exc)
        except Exception as exc:  # every request still ends with a FINAL
            log.exception("preparing a request failed")
            fail(EngineError("inference_error", f"preparing the request failed: {type(exc).__name__}"))
        finally:
            with self._lock:
                self._waiting -= 1

    def shutdown(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
