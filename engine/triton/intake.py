"""Request intake: the checks of the `cache_salt` and `tenant` inputs and of `priority`, and the slow lane, where
what can take seconds runs off Triton's one request thread.

Why: `execute()` runs on the stub's only request thread, so a 21 s grammar compile or the decode of sixteen large
images there delayed every request behind it. A request that needs either is prepared here
instead, on a few worker threads, and then submitted; a plain request is still prepared inline (tokenizing is
fast) and so never waits behind a slow one. The lane is bounded: past `limit` waiting preparations a request is
refused with QUEUE_FULL at once, like a full engine queue.
"""

from __future__ import annotations

import json
import logging
import math
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


PRIORITY_BOUND = 1000  # the gateway's bound too (gateway/contracts/common.py `Priority`)
TENANT_MAX_CHARS = 256
MAX_TENANT_WEIGHT = 1000.0


def checked_priority(params: object) -> int:
    """`priority` out of the `sampling_parameters` object (it is scheduling, not sampling, so SamplingParams never
    sees it): an integer in [-1000, 1000], lower runs earlier; absent: 0. Triton's own clients reach the model
    without the gateway, so it is checked here too."""
    if not isinstance(params, dict) or "priority" not in params:
        return 0
    value = params.pop("priority")
    if type(value) is not int or not -PRIORITY_BOUND <= value <= PRIORITY_BOUND:
        raise EngineError("invalid_request", f"priority must be an integer in [-{PRIORITY_BOUND}, "
                          f"{PRIORITY_BOUND}]", "priority")
    return value


def checked_tenant(raw: str | None) -> tuple[str | None, float]:
    """The `tenant` input, JSON `{"id": str, "weight": number}` -> (id, weight); absent: (None, 1.0), the one shared
    tenant. The id is never put in an error message or a log line: it identifies a tenant."""
    if raw is None:
        return None, 1.0
    try:
        value = json.loads(raw)
    except json.JSONDecodeError:
        value = None
    tenant = value.get("id") if isinstance(value, dict) else None
    weight = value.get("weight", 1.0) if isinstance(value, dict) else None
    if not isinstance(tenant, str) or not 0 < len(tenant) <= TENANT_MAX_CHARS:
        raise EngineError("invalid_request", f"tenant must be a JSON object whose 'id' is 1 to {TENANT_MAX_CHARS} "
                          "characters", "tenant")
    if isinstance(weight, bool) or not isinstance(weight, (int, float)) or not math.isfinite(weight) \
            or not 0 < weight <= MAX_TENANT_WEIGHT:
        raise EngineError("invalid_request", f"tenant 'weight' must be a number in (0, {MAX_TENANT_WEIGHT:g}]",
                          "tenant")
    return tenant, float(weight)


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
