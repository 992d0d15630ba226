"""Health, readiness, metrics, OpenAPI."""

from __future__ import annotations

import json
from typing import Any

import orjson

from gateway import engine_gauges
from gateway.drain import Drain
from gateway.errors import format_retry_after
from gateway.metrics import render_metrics
from gateway.profile import ModelProfile
from gateway.registry import ModelRegistry


class HealthResource:
    async def on_get(self, req, resp) -> None:
        resp.data = orjson.dumps({"status": "ok"})
        resp.content_type = "application/json"


READY_MAX_AGE_S = 1.0


class GatewayHealthResource:
    """GET /health in the contract's shape (docs/contract.md, "Health and operational routes"): `{status:
    healthy|degraded, type: gateway, configured_gpu_types, live_gpu_types, cluster, workers, models}`.

    Always 200, as SIE's gateway answers: `degraded` is in the body. The real sie-sdk reads this body to wait for
    capacity (`get_capacity`, `wait_for_capacity`) and to tell a gateway from a worker (`watch`), and it raises on any
    error status, so a 503 here broke all three exactly when nothing was served yet. Readiness is `/readyz` (503
    until a model can be served). It reads the registry's last refresh (at most a second old), never Triton per
    call."""

    def __init__(self, registry: ModelRegistry) -> None:
        self.registry = registry

    async def on_get(self, req, resp) -> None:
        await self.registry.refresh_if_stale(max_age_s=READY_MAX_AGE_S)
        resp.content_type = "application/json"
        resp.data = orjson.dumps(gateway_health(self.registry))


def gateway_health(registry: ModelRegistry) -> dict[str, Any]:
    """The cluster as this gateway sees it: each Triton endpoint is a worker, healthy or not.

    `degraded` when a worker is unreachable, a model is out of service on a reachable one (loading, unavailable,
    or withdrawn after its process died), or nothing is served at all."""
    endpoints = registry.endpoints
    known = {p.triton_model: p for e in endpoints for p in (*e.models.values(), *e.withdrawn.values())}
    models: dict[str, dict[str, Any]] = {}
    workers = []
    for e in endpoints:
        serving = sorted(e.models) if e.healthy else []
        # an unreachable endpoint's last model states are stale: it counts as one unhealthy worker, nothing more;
        # a model still loading has no profile yet and goes by its Triton name
        out = {known[n].name if n in known else n: known.get(n) for n in e.not_ready} if e.healthy else {}
        unavailable = sorted(out)
        for name in serving:
            entry = _model_entry(models, name, e.models[name])
            entry["workers"].append(e.name)
            entry["gpu_types"].add(e.pool.machine_profile)
        for name in unavailable:
            _model_entry(models, name, out[name])["unavailable_on"].append(e.name)
        # the real sie-sdk's WorkerInfo names (`get_capacity(gpu=...)` filters on `gpu`), then this gateway's own
        workers.append({"name": e.name, "gpu": e.pool.machine_profile, "healthy": e.healthy,
                        "loaded_models": serving, "pool": e.pool.name, "remote": e.config.remote,
                        "unavailable_models": unavailable})
    for entry in models.values():
        serving_somewhere = bool(entry["workers"])
        entry.update(status="serving" if serving_somewhere else "unavailable",
                     state="loaded" if serving_somewhere else "available", worker_count=len(entry["workers"]),
                     gpu_types=sorted(entry["gpu_types"]))
    served = registry.profiles()
    out_of_service = any(m["unavailable_on"] for m in models.values())
    healthy = bool(served) and all(e.healthy for e in endpoints) and not out_of_service
    return {
        "status": "healthy" if healthy else "degraded",
        "type": "gateway",
        # A pool's machine profile is its gpu type: the name a client selects with X-SIE-MACHINE-PROFILE or a
        # `model:profile` suffix, which is what SIE's gpu types are for. A CPU-only deployment (deploy/k8s/base:
        # `default`) reports that name as is, not an invented `cpu`: the gateway has no view of the hardware, and
        # every type it reports must be one routing accepts.
        "configured_gpu_types": sorted({p.machine_profile for p in registry.settings.pools}),
        "live_gpu_types": sorted({e.pool.machine_profile for e in endpoints if e.healthy and e.models}),
        "cluster": {
            "worker_count": len(workers),
            # unknown here, so 0 rather than a guess: Triton's model API lists models, not devices, and a
            # machine profile is a label, not a count
            "gpu_count": 0,
            "models_loaded": len(served),
            # 0: the request counter is per gunicorn process and a rate needs two samples of every process's
            # counter; the cluster rate is Prometheus' `rate(sie_gateway_requests_total[1m])` over /metrics
            "total_qps": 0.0,
        },
        "workers": workers,
        "models": [models[name] for name in sorted(models)],
    }


def _model_entry(models: dict[str, dict[str, Any]], name: str, profile: ModelProfile | None) -> dict[str, Any]:
    if name not in models:
        # `name`, `state`, `worker_count`, `gpu_types`: the sie-sdk's ModelSummary; `id` and the rest: this gateway's
        models[name] = {"id": name, "name": name, "sie_id": profile.sie_id if profile is not None else None,
                        "workers": [], "unavailable_on": [], "gpu_types": set()}
    return models[name]


class VersionResource:
    """GET /version in vLLM's shape: `{"version": ...}` (the SIE contract version this gateway serves)."""

    def __init__(self, version: str) -> None:
        self.body = orjson.dumps({"version": version})

    async def on_get(self, req, resp) -> None:
        resp.content_type = "application/json"
        resp.data = self.body


class ReadyResource:
    def __init__(self, registry: ModelRegistry, drain: Drain) -> None:
        self.registry = registry
        self.drain = drain

    async def on_get(self, req, resp) -> None:
        if self.drain.draining:  # SIGTERM: out of the load balancer at once, whatever Triton says
            resp.status, resp.content_type = 503, "application/json"
            resp.data = orjson.dumps({"status": "draining", "healthy_workers": 0})
            return
        # readiness reflects Triton as of at most a second ago: fresh enough for a probe, and open to anyone
        # without a Triton call per request (concurrent probes share one refresh)
        await self.registry.refresh_if_stale(max_age_s=READY_MAX_AGE_S)
        healthy = sum(1 for e in self.registry.endpoints if e.healthy and e.models)
        resp.content_type = "application/json"
        if healthy:
            resp.data = orjson.dumps({"status": "ready", "healthy_workers": healthy})
        else:
            resp.status = 503
            # the Retry-After of every other answer in the same outage (503 PROVISIONING)
            resp.set_header("Retry-After", format_retry_after(self.registry.settings.provisioning_retry_after_s))
            resp.data = orjson.dumps({"status": "not_ready", "healthy_workers": 0})


class MetricsResource:
    """The gateway's metrics; with `engine_metrics_url` (the pod's own Triton), the engine's gauges under vLLM's
    names after them, read at each scrape (gateway/engine_gauges.py)."""

    def __init__(self, engine_metrics_url: str | None = None, registry: ModelRegistry | None = None) -> None:
        self.engine_metrics_url = engine_metrics_url
        self.registry = registry

    async def on_get(self, req, resp) -> None:
        body, resp.content_type = render_metrics()
        if self.engine_metrics_url:
            served = {p.triton_model: p.name for p in self.registry.profiles()} if self.registry else {}
            body += (await engine_gauges.scrape(self.engine_metrics_url, served)).encode()
        resp.data = body


class OpenAPIResource:
    def __init__(self, document: dict) -> None:
        self.body = json.dumps(document).encode()  # built once; may hold integers beyond orjson's 64-bit range

    async def on_get(self, req, resp) -> None:
        resp.content_type = "application/json"
        resp.data = self.body
