"""Prometheus metrics of the gateway (multi-process aware under gunicorn via PROMETHEUS_MULTIPROC_DIR)."""

from __future__ import annotations

import os

from prometheus_client import (
    CONTENT_TYPE_LATEST,
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    generate_latest,
    multiprocess,
)

# the contract's names and labels (docs/contract.md, "Metrics"): `endpoint` is the route ("chat", "generate", ...),
# `machine_profile` the one a request asked for ("default" when none, "" off the inference routes)
REQUESTS = Counter("sie_gateway_requests_total", "HTTP requests", ["endpoint", "status", "machine_profile", "model"])
LATENCY = Histogram(
    "sie_gateway_request_latency_seconds", "Request latency (to last byte)", ["endpoint", "machine_profile", "model"],
    buckets=(0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120),
)
TTFT = Histogram(
    "sie_gateway_ttft_seconds", "Time to first model event", ["endpoint", "model"],
    buckets=(0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2, 5, 10, 30),
)
IN_FLIGHT = Gauge("sie_gateway_in_flight_requests", "Requests in flight", ["endpoint"], multiprocess_mode="livesum")
# Triton endpoints by health, as this gateway process last saw them (every process refreshes on its own)
WORKERS = Gauge("sie_gateway_workers", "Triton endpoints by status", ["status"], multiprocess_mode="mostrecent")
PROVISIONING = Counter("sie_gateway_provisioning_responses_total", "503 PROVISIONING answers", ["machine_profile"])
UPSTREAM_ERRORS = Counter("sie_gateway_upstream_errors_total", "Errors from Triton", ["code"])
# every error a client sees, by its contract code: HTTP error responses and in-band stream error events
ERRORS = Counter("sie_gateway_errors_total", "Errors answered to clients, by code", ["code", "status"])
# 429s of the per-key limits (gateway/rate_limits.py) by tenant: a keyed hash of the tenant (never its name or key),
# the first MAX_TENANT_LABELS a process sees and "other" past them, and the limit hit ("requests" or "tokens")
RATE_LIMITED = Counter("sie_gateway_rate_limited_total", "429 answers of per-key limits, by tenant and limit",
                       ["tenant", "limit"])


def render_metrics() -> tuple[bytes, str]:
    if os.environ.get("PROMETHEUS_MULTIPROC_DIR"):
        registry = CollectorRegistry()
        multiprocess.MultiProcessCollector(registry)
        return generate_latest(registry), CONTENT_TYPE_LATEST
    return generate_latest(), CONTENT_TYPE_LATEST
