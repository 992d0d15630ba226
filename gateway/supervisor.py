"""Supervision of model processes: a dead instance is found within seconds, its requests end, and it is reloaded.

Triton's Python backend never restarts a model's stub process once it is gone (kill -9, the OOM killer, a
segfault, the engine's own fatal exit) and keeps reporting the model READY, while its in-flight requests stay
silent for good (triton-inference-server/server #7862, #8604). The gateway sees it two ways: a request answered
"Stub process '...' is not healthy" (about 1 s after it was sent), and a probe every `model_probe_s` of every
ready model, which finds it with no traffic at all. Then, per endpoint and model:

1. the model leaves routing, `/v1/models` and `/readyz` at once (new requests: 503 MODEL_LOADING, Retry-After 5);
2. its in-flight requests end with that error (streams in-band, then `[DONE]`);
3. it is reloaded through Triton's repository API (unload, then load: tritonserver runs with
   `--model-control-mode=explicit`), unless another gateway worker already is (the model is not READY, or a
   second probe finds it alive); a failed load is retried with backoff. Meanwhile the model is UNAVAILABLE in
   Triton, so Triton's `/v2/health/ready` fails: the orchestrator's liveness check restarts what cannot recover
   in place.
"""

from __future__ import annotations

import asyncio
import logging
import os
import random
import time
from collections.abc import Sequence
from typing import Protocol

from gateway.endpoint import Endpoint
from gateway.errors import ModelProcessDied
from gateway.settings import Settings

log = logging.getLogger(__name__)

_RETRY_BACKOFF_S = (5.0, 10.0, 20.0, 40.0, 60.0)  # between failed reloads; the last one repeats
_WAIT_FOR_OTHERS_S = 900.0  # longest wait for a reload another worker started


class SupervisedModels(Protocol):
    """What the supervisor sees of the model registry: the endpoints it watches, and the verbs that take a model out
    of service, put it back and re-read what Triton serves. The registry knows nothing of who calls them."""

    @property
    def endpoints(self) -> Sequence[Endpoint]: ...

    def withdraw(self, endpoint: Endpoint, triton_model: str) -> None: ...

    def restore(self, endpoint: Endpoint, triton_model: str) -> None: ...

    async def refresh(self) -> None: ...


class ModelSupervisor:
    def __init__(self, models: SupervisedModels, settings: Settings) -> None:
        self.models = models
        self.probe_s = settings.model_probe_s
        self.reload_enabled = settings.model_reload
        self._recovering: dict[tuple[str, str], asyncio.Task] = {}  # (endpoint url, Triton model) -> task
        self._probe_task: asyncio.Task | None = None

    def start(self) -> None:
        """Probe every `model_probe_s` (0: never; requests still report a dead process)."""
        if self._probe_task is None and self.probe_s > 0:
            self._probe_task = asyncio.get_running_loop().create_task(self._probe_loop())

    async def _probe_loop(self) -> None:
        while True:
            await asyncio.sleep(self.probe_s)
            try:
                await self.probe_all()
            except Exception:
                log.exception("model liveness probe failed")

    def is_recovering(self, endpoint: Endpoint, triton_model: str) -> bool:
        return (endpoint.config.url, triton_model) in self._recovering

    async def probe_all(self) -> None:
        """Probe every ready model on every reachable endpoint (concurrently)."""
        checks = [(e, p.triton_model) for e in self.models.endpoints if e.healthy for p in e.models.values()]
        results = await asyncio.gather(*(e.client.probe(m) for e, m in checks), return_exceptions=True)
        for (endpoint, model), alive in zip(checks, results, strict=True):
            if alive is False:
                self.model_died(endpoint, model, "a liveness probe was answered 'Stub process is not healthy'")
        # withdrawn and not being reloaded here (reload off): back once Triton's instance answers again
        idle = [(e, m) for e in self.models.endpoints if e.healthy for m in e.withdrawn
                if not self.is_recovering(e, m)]
        results = await asyncio.gather(*(e.client.probe(m) for e, m in idle), return_exceptions=True)
        for (endpoint, model), alive in zip(idle, results, strict=True):
            if alive is True:
                self.models.restore(endpoint, model)
                log.warning("model %s on endpoint %s answers again; back in service", model, endpoint.name)

    def model_died(self, endpoint: Endpoint, triton_model: str, why: str) -> None:
        """Take the model out of service on this endpoint, end its requests, and start its recovery."""
        key = (endpoint.config.url, triton_model)
        if key in self._recovering:
            return
        self.models.withdraw(endpoint, triton_model)
        error = ModelProcessDied(f"the model process of '{triton_model}' died; it is being reloaded, retry shortly")
        ended = endpoint.client.abort(triton_model, error)
        log.error("model %s on endpoint %s: its model process is dead (%s); it leaves routing, %d in-flight "
                  "requests end with MODEL_LOADING, and it is %s (gateway worker %d)", triton_model, endpoint.name,
                  why, ended, "being reloaded" if self.reload_enabled else "NOT reloaded (SIE_GATEWAY_MODEL_RELOAD=0)",
                  os.getpid())
        if not self.reload_enabled:
            return  # stays withdrawn (refreshes keep it out) until Triton answers the probe again
        self._recovering[key] = asyncio.get_running_loop().create_task(self._recover(endpoint, triton_model))

    async def _recover(self, endpoint: Endpoint, triton_model: str) -> None:
        started = time.monotonic()
        try:
            attempt = 0
            while True:
                try:
                    how = await self._reload_once(endpoint, triton_model)
                    break
                except Exception as exc:  # a failed load: Triton now reports the model UNAVAILABLE
                    delay = _RETRY_BACKOFF_S[min(attempt, len(_RETRY_BACKOFF_S) - 1)]
                    attempt += 1
                    log.error("model %s on endpoint %s: reload attempt %d failed (%s); Triton's /v2/health/ready "
                              "fails until it loads; retrying in %.0f s", triton_model, endpoint.name, attempt,
                              _describe(exc), delay)
                    await asyncio.sleep(delay)
            self.models.restore(endpoint, triton_model)
            await self.models.refresh()
            log.warning("model %s on endpoint %s is serving again, %.1f s after its process died was seen (%s)",
                        triton_model, endpoint.name, time.monotonic() - started, how)
        finally:
            self._recovering.pop((endpoint.config.url, triton_model), None)

    async def _reload_once(self, endpoint: Endpoint, triton_model: str) -> str:
        """Reload, unless another gateway worker (or replica) is at it or has done it.

        Each worker finds the death on its own, so two may act at once; an unload that lands after the other's
        load would take the fresh instance down again (seen: 94 s to recover instead of 38). So: a random pause
        (workers that found it in the same probe round drift apart), a probe (alive: done), then the state,
        read right before the unload (LOADING or UNLOADING: another worker's reload, wait for it)."""
        client = endpoint.client
        await asyncio.sleep(random.uniform(0.0, 0.5))
        if await client.probe(triton_model) is True:
            return "another gateway worker had reloaded it"
        state = await client.model_state(triton_model)
        if state in ("LOADING", "UNLOADING"):
            await self._wait_for_load(endpoint, triton_model)
            return "another gateway worker reloaded it"
        await client.reload(triton_model)
        return "reloaded through Triton's repository API"

    async def _wait_for_load(self, endpoint: Endpoint, triton_model: str) -> None:
        deadline = time.monotonic() + _WAIT_FOR_OTHERS_S
        while time.monotonic() < deadline:
            await asyncio.sleep(0.5)
            state = await endpoint.client.model_state(triton_model)
            if state == "READY" and await endpoint.client.probe(triton_model) is not False:
                return
            if state not in ("LOADING", "UNLOADING"):
                raise RuntimeError(f"the reload another worker started left it {state}")
        raise TimeoutError("the reload another worker started did not finish")

    async def stop(self) -> None:
        if self._probe_task is not None:
            self._probe_task.cancel()
            self._probe_task = None
        for task in list(self._recovering.values()):
            task.cancel()
        await asyncio.gather(*self._recovering.values(), return_exceptions=True)


def _describe(exc: BaseException) -> str:
    details = getattr(exc, "details", None)
    text = details() if callable(details) else str(exc)
    return f"{type(exc).__name__}: {(text or '').splitlines()[0][:300] if text else ''}"
