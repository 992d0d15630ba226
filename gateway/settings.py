"""Gateway settings: read once from the environment (and an optional YAML routing file), then passed in."""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

VERSION = "0.10.1"  # SIE wire-contract version we implement (the SDK warns on major/minor skew)
# relative to the gateway's working directory; `off` disables storing (then `store: true` is a 400)
DEFAULT_RESPONSES_STORE = ".cache/sie-gateway/responses.sqlite3"
# the HMAC secret behind key-derived tenants (gateway/auth_tokens.py); replicas that share a store share it too
DEFAULT_TENANT_SECRET = ".cache/sie-gateway/tenant.secret"
PREFIX_CACHE_SCOPES = ("tenant", "global")


@dataclass(frozen=True)
class EndpointConfig:
    url: str
    remote: bool = False
    name: str = ""
    # the KV event publishers of this endpoint's models, (events, replay or None): which blocks it holds, for
    # routing (gateway/kv_blocks.py)
    kv_events: tuple[tuple[str, str | None], ...] = ()


@dataclass(frozen=True)
class PoolConfig:
    name: str
    machine_profile: str = "default"
    endpoints: tuple[EndpointConfig, ...] = ()
    dns: str | None = None  # host:port (a headless Service): endpoints are its addresses, re-resolved
    dns_refresh_s: float = 5.0
    dns_remote: bool = False  # whether the discovered endpoints count as remote (X-SIE-Remote: forbid)


@dataclass(frozen=True)
class Settings:
    pools: tuple[PoolConfig, ...]
    auth_mode: str = "none"
    auth_tokens: tuple[str, ...] = ()
    auth_exempt_operational: bool = False
    # POST /v1/load_lora_adapter, /v1/unload_lora_adapter (docs/lora.md); off as vLLM's VLLM_ALLOW_RUNTIME_LORA_UPDATING
    allow_runtime_lora: bool = False
    auth_tokens_file: str | None = None  # keys (and their tenants), re-read on change or SIGHUP; docs/auth.md
    tenant_secret_file: str | None = None  # None: a per-process secret (tests); from_env always names a file
    prefix_cache_scope: str = "tenant"  # "global": one prefix cache shared by every key (single-tenant deployments)
    default_max_tokens: int = 1024
    chat_body_limit: int = 16 * 1024 * 1024
    generate_body_limit: int = 24 * 1024 * 1024
    body_read_timeout_s: float = 60.0  # longest wait for the next piece of a request body (then 408)
    first_chunk_timeout_s: float = 120.0
    inter_chunk_timeout_s: float = 60.0
    overall_timeout_s: float = 600.0
    max_timeout_s: float = 3600.0  # operator cap on the per-request `options.*_timeout_s`
    provisioning_retry_after_s: float = 60.0  # Retry-After on 503 PROVISIONING (the contract says 60)
    stream_buffer_events: int = 64  # events queued per stream before deltas are coalesced (slow readers)
    keepalive_interval_s: float = 15.0
    model_refresh_s: float = 5.0
    model_probe_s: float = 2.0  # liveness probe of every ready model (gateway/supervisor.py); 0 turns it off
    model_reload: bool = True  # reload a model whose process died (needs tritonserver --model-control-mode=explicit)
    server_version: str = VERSION
    log_level: str = "INFO"
    # Stored Responses (gateway/responses_store.py): a SQLite file shared by the workers, or None (off)
    responses_store: str | None = None
    responses_store_max_rows: int = 10_000
    responses_store_max_bytes: int = 256 * 1024 * 1024
    responses_store_ttl_s: float = 7 * 24 * 3600.0
    # the pod's own Triton metrics (`http://localhost:8002/metrics`): /metrics adds the engine's gauges under vLLM's
    # names for an endpoint picker (gateway/engine_gauges.py); unset: only the gateway's own metrics
    engine_metrics_url: str | None = None
    # a folder every gunicorn worker of this gateway shares (docker/gunicorn.conf.py makes one per start): a run-time
    # LoRA change made through one worker is seen by the others before their next request (gateway/adapter_changes.py)
    state_dir: str | None = None

    @classmethod
    def from_env(cls, env: dict[str, str] | None = None) -> Settings:
        env = dict(os.environ if env is None else env)
        pools = _pools_from(env)
        tokens = env.get("SIE_AUTH_TOKENS") or env.get("SIE_AUTH_TOKEN") or ""
        scope = env.get("SIE_PREFIX_CACHE_SCOPE", "tenant").strip().lower() or "tenant"
        if scope not in PREFIX_CACHE_SCOPES:
            raise ValueError(f"SIE_PREFIX_CACHE_SCOPE must be one of {', '.join(PREFIX_CACHE_SCOPES)}, got {scope!r}")
        return cls(
            pools=pools,
            auth_mode=env.get("SIE_AUTH_MODE", "none").strip().lower() or "none",
            auth_tokens=tuple(t.strip() for t in tokens.split(",") if t.strip()),
            auth_exempt_operational=env.get("SIE_AUTH_EXEMPT_OPERATIONAL", "").lower() in ("1", "true", "yes"),
            allow_runtime_lora=env.get("SIE_ALLOW_RUNTIME_LORA_UPDATING", "").lower() in ("1", "true", "yes"),
            auth_tokens_file=env.get("SIE_AUTH_TOKENS_FILE") or None,
            tenant_secret_file=env.get("SIE_TENANT_SECRET_FILE") or DEFAULT_TENANT_SECRET,
            prefix_cache_scope=scope,
            default_max_tokens=int(env.get("SIE_GATEWAY_DEFAULT_MAX_TOKENS", "1024")),
            chat_body_limit=int(env.get("SIE_GATEWAY_CHAT_BODY_LIMIT", str(16 * 1024 * 1024))),
            generate_body_limit=int(env.get("SIE_GATEWAY_GENERATE_BODY_LIMIT", str(24 * 1024 * 1024))),
            body_read_timeout_s=float(env.get("SIE_GATEWAY_BODY_READ_TIMEOUT_S", "60")),
            first_chunk_timeout_s=float(env.get("SIE_GATEWAY_FIRST_CHUNK_TIMEOUT_S", "120")),
            inter_chunk_timeout_s=float(env.get("SIE_GATEWAY_INTER_CHUNK_TIMEOUT_S", "60")),
            overall_timeout_s=float(env.get("SIE_GATEWAY_OVERALL_TIMEOUT_S", "600")),
            max_timeout_s=float(env.get("SIE_GATEWAY_MAX_TIMEOUT_S", "3600")),
            provisioning_retry_after_s=float(env.get("SIE_GATEWAY_PROVISIONING_RETRY_AFTER_S", "60")),
            keepalive_interval_s=float(env.get("SIE_GATEWAY_SSE_KEEPALIVE_S", "15")),
            model_refresh_s=float(env.get("SIE_GATEWAY_MODEL_REFRESH_S", "5")),
            model_probe_s=float(env.get("SIE_GATEWAY_MODEL_PROBE_S", "2")),
            model_reload=env.get("SIE_GATEWAY_MODEL_RELOAD", "1").lower() not in ("0", "false", "no", "off"),
            log_level=env.get("GATEWAY_LOG_LEVEL", "INFO").upper(),
            responses_store=env.get("SIE_RESPONSES_STORE", DEFAULT_RESPONSES_STORE),
            responses_store_max_rows=int(env.get("SIE_RESPONSES_STORE_MAX_ROWS", "10000")),
            responses_store_max_bytes=int(env.get("SIE_RESPONSES_STORE_MAX_BYTES", str(256 * 1024 * 1024))),
            responses_store_ttl_s=float(env.get("SIE_RESPONSES_STORE_TTL_S", str(7 * 24 * 3600))),
            engine_metrics_url=env.get("SIE_ENGINE_METRICS_URL") or None,
            state_dir=env.get("SIE_GATEWAY_STATE_DIR") or None,
        )


def _pools_from(env: dict[str, str]) -> tuple[PoolConfig, ...]:
    """`SIE_GATEWAY_CONFIG` (YAML with `pools:`) wins; else one local Triton at TRITON_GRPC_URL.

    A pool lists `endpoints: [{url, remote, name, kv_events}]`, or names `dns: host:port` (with `dns_refresh_s`,
    `dns_remote`) whose addresses are its endpoints (gateway/discovery.py), or both."""
    path = env.get("SIE_GATEWAY_CONFIG")
    if path:
        data: dict[str, Any] = yaml.safe_load(Path(path).read_text()) or {}
        pools = []
        for name, spec in (data.get("pools") or {}).items():
            endpoints = tuple(
                EndpointConfig(url=e["url"], remote=bool(e.get("remote", False)), name=e.get("name", e["url"]),
                               kv_events=_kv_event_sources(e.get("kv_events")))
                for e in spec.get("endpoints", [])
            )
            dns = spec.get("dns")
            if dns is not None:
                split_host_port(str(dns))  # a malformed source fails at start, not at the first refresh
            pools.append(PoolConfig(str(name).lower(), spec.get("machine_profile", "default"), endpoints,
                                    dns=str(dns) if dns is not None else None,
                                    dns_refresh_s=float(spec.get("dns_refresh_s", 5.0)),
                                    dns_remote=bool(spec.get("dns_remote", False))))
        if pools:
            return tuple(pools)
    url = env.get("TRITON_GRPC_URL") or f"localhost:{env.get('TRITON_GRPC_PORT', '8001')}"
    return (PoolConfig("default", "default", (EndpointConfig(url=url, name="local"),)),)


def _kv_event_sources(value: Any) -> tuple[tuple[str, str | None], ...]:
    """An endpoint's `kv_events`: one publisher per model it serves, each `tcp://host:port` or
    `{events: tcp://host:port, replay: tcp://host:port}` (the profile's kv_events_endpoint and
    kv_events_replay_endpoint)."""
    items = value if isinstance(value, list) else [] if value is None else [value]
    sources = []
    for item in items:
        if isinstance(item, dict):
            sources.append((str(item["events"]), str(item["replay"]) if item.get("replay") else None))
        else:
            sources.append((str(item), None))
    return tuple(sources)


def split_host_port(value: str) -> tuple[str, int]:
    """A pool's `dns` source: `name:8001` or `[v6]:8001`."""
    host, sep, port = value.rpartition(":")
    if not sep or not host or not port.isdigit():
        raise ValueError(f"a pool's dns must be host:port, got {value!r}")
    return host.strip("[]"), int(port)
