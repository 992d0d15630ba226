"""Model discovery across Triton endpoints: which endpoint serves which model, refreshed in the background."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable

from contract.profile import ProfileError
from gateway.adapter_changes import AdapterChanges
from gateway.discovery import DnsSource, Resolver, resolve_dns
from gateway.endpoint import Endpoint
from gateway.errors import ModelNotFound, Provisioning, Unavailable, quoted
from gateway.lora_adapters import CONTROL_INPUT, with_live_adapters
from gateway.metrics import WORKERS
from gateway.profile import ModelProfile, canonical_id
from gateway.settings import Settings
from gateway.triton.client import TritonClient

log = logging.getLogger(__name__)


class ModelRegistry:
    def __init__(self, settings: Settings, client_factory: Callable[[str], TritonClient] = TritonClient,
                 resolver: Resolver = resolve_dns) -> None:
        self.settings = settings
        self._client_factory = client_factory
        self.endpoints = [
            Endpoint(config=e, pool=pool, client=client_factory(e.url))
            for pool in settings.pools
            for e in pool.endpoints
        ]
        self._dns = [DnsSource(pool, resolver) for pool in settings.pools if pool.dns]
        self._retired: list[Endpoint] = []  # dropped from DNS; closed once their last request is done
        self.refreshed_once = False
        self.refreshed_at = 0.0
        # Triton name -> the profile it was last served with, on any endpoint: a model that loads again (a reload, a
        # restarted Triton) is known by its served id while Triton lists only its name
        self._served_as: dict[str, ModelProfile] = {}
        self._refresh_lock = asyncio.Lock()
        self._task: asyncio.Task | None = None
        self.adapter_changes = AdapterChanges(settings.state_dir)

    async def refresh(self) -> None:
        await self._rediscover()
        await asyncio.gather(*(self._refresh_endpoint(e) for e in self.endpoints))
        healthy = sum(e.healthy for e in self.endpoints)
        WORKERS.labels(status="healthy").set(healthy)
        WORKERS.labels(status="unhealthy").set(len(self.endpoints) - healthy)
        self.refreshed_once = True
        self.refreshed_at = time.monotonic()

    async def refresh_if_stale(self, max_age_s: float = 1.0) -> bool:
        """Refresh now unless a refresh finished within `max_age_s` (concurrent callers share one).

        Used before answering 404/503 for a model: it may have loaded since the last background refresh
        (a fresh worker's first request, a model that just became ready)."""
        started = time.monotonic()
        async with self._refresh_lock:
            if self.refreshed_at >= started - max_age_s and self.refreshed_once:
                return self.refreshed_at >= started
            await self.refresh()
            return True

    async def catch_up(self) -> None:
        """Refresh first when a sibling worker changed the run-time LoRA adapters since this one last looked."""
        if self.adapter_changes.pending() is None:
            return
        async with self._refresh_lock:
            stamp = self.adapter_changes.pending()
            if stamp is not None:  # not already caught up by a concurrent caller
                await self.refresh()
                self.adapter_changes.seen = stamp

    async def _refresh_endpoint(self, endpoint: Endpoint) -> None:
        try:
            listed = await endpoint.client.list_models()
        except Exception as exc:  # unreachable endpoint: keep it out of routing until it is back
            if endpoint.healthy:
                log.warning("endpoint %s is unreachable: %s", endpoint.name, type(exc).__name__)
            endpoint.healthy = False
            endpoint.models = {}
            return
        models, not_ready, loading = {}, set(), set()
        for name, state, params, inputs in listed:
            if state == "READY" and name in endpoint.withdrawn:
                not_ready.add(name)  # Triton still says READY about a dead process (until it is reloaded)
            elif state == "READY":
                try:
                    profile = ModelProfile.from_triton_config(name, params, inputs)
                except ProfileError as exc:  # not served; the other models are (contract/profile.py)
                    log.error("model %s on %s is not served: %s", name, endpoint.name, exc)
                    continue
                if self.settings.allow_runtime_lora and CONTROL_INPUT in inputs:  # adapters loaded at run time
                    profile = await with_live_adapters(endpoint.client, profile)
                models[profile.name] = profile
                self._served_as[name] = profile
            else:
                not_ready.add(name)
                if state == "LOADING":
                    loading.add(name)
        endpoint.models, endpoint.not_ready, endpoint.loading, endpoint.healthy = models, not_ready, loading, True

    async def _rediscover(self) -> None:
        """Re-resolve each DNS pool that is due: new addresses become endpoints, gone ones leave routing.

        A dropped endpoint keeps its client until its in-flight requests end (a draining pod leaves DNS
        while its streams still run)."""
        now = time.monotonic()
        for source in self._dns:
            if not source.due(now):
                continue
            configs = await source.resolve()
            if configs is None:
                continue
            wanted = {c.url: c for c in configs}
            kept, dropped = [], []
            for endpoint in self.endpoints:
                if endpoint.discovered and endpoint.pool is source.pool and endpoint.config.url not in wanted:
                    dropped.append(endpoint)
                else:
                    kept.append(endpoint)
            present = {e.config.url for e in kept if e.discovered and e.pool is source.pool}
            kept += [Endpoint(config=c, pool=source.pool, client=self._client_factory(c.url), discovered=True)
                     for url, c in wanted.items() if url not in present]
            self.endpoints = kept
            self._retired += dropped
        for endpoint in [e for e in self._retired if e.outstanding <= 0]:
            self._retired.remove(endpoint)
            await endpoint.client.close()

    def provisioning(self, message: str) -> Provisioning:
        """503 PROVISIONING with the operator's Retry-After (the contract's 60 s by default)."""
        return Provisioning(message, retry_after=self.settings.provisioning_retry_after_s)

    def mark_unhealthy(self, endpoint: Endpoint) -> None:
        endpoint.healthy = False

    def withdraw(self, endpoint: Endpoint, triton_model: str) -> None:
        """Out of routing, `/v1/models` and `/readyz` now: the model's process on this endpoint is dead."""
        for name, profile in list(endpoint.models.items()):
            if profile.triton_model == triton_model:
                endpoint.withdrawn[triton_model] = profile
                del endpoint.models[name]
        endpoint.withdrawn.setdefault(triton_model, ModelProfile(triton_model, triton_model))
        endpoint.not_ready.add(triton_model)

    def restore(self, endpoint: Endpoint, triton_model: str) -> None:
        """Back in service at the next refresh: the model was reloaded."""
        endpoint.withdrawn.pop(triton_model, None)

    def start(self) -> None:
        if self._task is None:
            self._task = asyncio.get_running_loop().create_task(self._loop())

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            self._task = None
        for endpoint in self.endpoints + self._retired:
            await endpoint.client.close()

    async def _loop(self) -> None:
        period = min([self.settings.model_refresh_s, *(s.pool.dns_refresh_s for s in self._dns)])
        while True:
            try:
                await self.refresh()
            except Exception:
                log.exception("model refresh failed")
            await asyncio.sleep(period)

    # -- lookups -------------------------------------------------------------------------------

    def profiles(self) -> list[ModelProfile]:
        seen: dict[str, ModelProfile] = {}
        for endpoint in self.endpoints:
            if endpoint.healthy:
                for name, profile in endpoint.models.items():
                    seen.setdefault(name, profile)
        return sorted(seen.values(), key=lambda p: p.name)

    def ready(self) -> bool:
        return any(e.healthy and e.models for e in self.endpoints)

    async def resolve(self, requested: str) -> tuple[ModelProfile, str | None]:
        """Client model id (canonical, SIE-safe, `:profile` suffix) -> (profile, machine profile or None).

        Before a 404/503 the registry re-asks Triton (shared, at most once a second): it may be behind (a
        worker's first request, a model that has just loaded)."""
        await self.catch_up()
        try:
            return self._lookup(requested)
        except (ModelNotFound, Unavailable):  # Provisioning included
            await self.refresh_if_stale()
            return self._lookup(requested)

    def _lookup(self, requested: str) -> tuple[ModelProfile, str | None]:
        model, machine_profile = split_profile_suffix(requested)
        wanted = {model, canonical_id(model)}
        for profile in self.profiles():
            if profile.name in wanted or profile.sie_id == model or profile.triton_model == model:
                return profile, machine_profile
        for profile in self.profiles():  # a LoRA adapter's name is a model id too (vLLM's convention)
            if model in profile.lora_adapters:
                return profile, machine_profile
        if not any(e.healthy for e in self.endpoints):
            raise self.provisioning("no Triton endpoint is reachable; provisioning in progress, retry shortly")
        named = quoted(canonical_id(model))  # messages name the canonical id, as the answers' `model` does
        # a loading model has no config yet: Triton lists only its name. Its served id is known when it was served
        # before (a reload); else its Triton name is matched loosely, with and without the org
        # (`org/Name-1.5B` ~ `name_1_5b`)
        loose = {_loose(w) for w in wanted} | {_loose(w.rpartition("/")[2]) for w in wanted}

        def is_wanted(triton_name: str) -> bool:
            before = self._served_as.get(triton_name)
            return _loose(triton_name) in loose if before is None else before.name in wanted or before.sie_id == model

        healthy = [e for e in self.endpoints if e.healthy]
        for endpoint in healthy:
            if any(p.name in wanted or p.sie_id == model for p in endpoint.withdrawn.values()):
                raise Unavailable(f"model {named} is being reloaded (its process died)",
                                  code="MODEL_LOADING", retry_after=5)
            if any(is_wanted(n) for n in endpoint.not_ready):
                raise Unavailable(f"model {named} is loading", code="MODEL_LOADING", retry_after=5)
        # a model loading for the first time may be this one under a Triton name that says nothing of its id: until
        # those loads end, "not found" cannot be told, so the answer is the retryable one (then 404 if still unknown)
        unknown_loads = sorted({n for e in healthy for n in e.loading if n not in self._served_as})
        if unknown_loads:
            raise Unavailable(f"model {named} is not served yet; {len(unknown_loads)} model(s) are still loading",
                              code="MODEL_LOADING", retry_after=5)
        raise ModelNotFound(f"Model {named} not found", param="model")


def _loose(name: str) -> str:
    return name.lower().replace("/", "_").replace("-", "_").replace(".", "_")


def split_profile_suffix(model: str) -> tuple[str, str | None]:
    """`org/name:profile` -> (`org/name`, `profile`); a `bundle:/org/name` prefix is dropped."""
    if ":/" in model:
        model = model.split(":/", 1)[1]
    if ":" in model:
        base, _, suffix = model.rpartition(":")
        if base and suffix:
            return base, suffix
    return model, None
