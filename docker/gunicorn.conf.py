"""Gunicorn settings for the gateway, shared by `make serve` and the gateway image.

    gunicorn -c docker/gunicorn.conf.py gateway.asgi:app

Environment (read here only; the app reads its own settings once at start):
GATEWAY_HOST (0.0.0.0), GATEWAY_PORT (8080), GATEWAY_WORKERS (2), GATEWAY_GRACEFUL_TIMEOUT (30 s),
GATEWAY_KEEPALIVE (75 s), GATEWAY_LOG_LEVEL (info), GATEWAY_ACCESS_LOG (off; 1/true to log request lines).
The worker class reads two more: GATEWAY_HEADER_TIMEOUT (30 s) and GATEWAY_MAX_HEADER_BYTES (64 KiB), see
gateway/worker.py.
"""

from __future__ import annotations

import os


def _int_env(name: str, default: int, minimum: int) -> int:
    raw = os.environ.get(name, "").strip()
    value = int(raw) if raw else default
    if value < minimum:
        raise ValueError(f"{name} must be >= {minimum}, got {value}")
    return value


bind = [f"{os.environ.get('GATEWAY_HOST', '0.0.0.0')}:{_int_env('GATEWAY_PORT', 8080, 1)}"]
worker_class = "gateway.worker.GatewayWorker"  # uvicorn + httptools + uvloop
workers = _int_env("GATEWAY_WORKERS", 2, 1)

# Each worker opens its own gRPC channel to Triton after the fork: importing the app in the master
# first would share grpc state across processes, which grpc does not support.
preload_app = False

# On SIGTERM, in-flight streams get this long to finish before the worker is killed.
graceful_timeout = _int_env("GATEWAY_GRACEFUL_TIMEOUT", 30, 1)
# The worker heartbeat; an async worker misses it only if its event loop is blocked this long.
timeout = 60
# Idle keep-alive (uvicorn's timeout_keep_alive): longer than a typical load balancer's idle
# timeout, so the balancer, not the gateway, closes idle connections and never races a reuse.
# It also bounds a connection that has not sent its first request yet (gateway/worker.py).
keepalive = _int_env("GATEWAY_KEEPALIVE", 75, 1)
# Never recycle workers by request count: a recycle would cut streams short.
max_requests = 0

# Access log off unless asked; when on, uvicorn logs the request line only (client, method, path,
# status): never bodies, headers or the query string (gateway/worker.py), so no prompt and no credential
# reaches the log.
accesslog = "-" if os.environ.get("GATEWAY_ACCESS_LOG", "").lower() in {"1", "true", "yes", "on"} else None
errorlog = "-"
loglevel = os.environ.get("GATEWAY_LOG_LEVEL", "info").lower()
proc_name = "sie-gateway"
# Gunicorn >= 25.1 opens a control socket at one fixed per-user path ($HOME/.gunicorn/gunicorn.ctl),
# so a second gateway on the machine (e2e tests beside `make serve`) would collide on it; unused here.
control_socket_disable = True

# The heartbeat file lives in RAM where there is one: a slow overlay filesystem (containers) can
# stall the heartbeat write and get healthy workers killed.
if os.path.isdir("/dev/shm"):
    worker_tmp_dir = "/dev/shm"

# Prometheus metrics aggregated across workers: each worker writes to a shared folder, and /metrics
# (served by any worker) reads them all. A fresh folder per gateway start; dead workers are marked.
if not os.environ.get("PROMETHEUS_MULTIPROC_DIR"):
    import tempfile

    os.environ["PROMETHEUS_MULTIPROC_DIR"] = tempfile.mkdtemp(prefix="sie-gateway-metrics-")

# State the workers share (gateway/adapter_changes.py): a fresh folder per gateway start, as for the metrics.
if not os.environ.get("SIE_GATEWAY_STATE_DIR"):
    import tempfile

    os.environ["SIE_GATEWAY_STATE_DIR"] = tempfile.mkdtemp(prefix="sie-gateway-state-")


def child_exit(server, worker) -> None:
    from prometheus_client import multiprocess

    multiprocess.mark_process_dead(worker.pid)


def when_ready(server) -> None:
    """On SIGTERM, shut the listening sockets down in the master, before any worker is signalled.

    The workers share one listening socket. Each worker closes its own copy when its SIGTERM arrives,
    but the kernel keeps completing handshakes while any copy is open, so between the first worker's
    503 on /readyz and the last worker's close a new connection was still taken (CI caught one).
    shutdown() on a listening socket ends it for every process that holds it: from here on a connect
    is refused. Skipped during a USR2 re-exec, where the new master serves on the same socket.

    On SIGHUP the workers re-read the keys file instead of being replaced."""
    import signal
    import socket

    handle_term = server.handle_term

    def refuse_new_connections_then_stop() -> None:
        if not getattr(server, "reexec_pid", 0):
            for listener in server.LISTENERS:
                try:
                    listener.sock.shutdown(socket.SHUT_RDWR)
                except OSError:  # already shut, or a socket kind without shutdown
                    pass
        handle_term()

    server.handle_term = refuse_new_connections_then_stop

    def reread_keys_in_every_worker() -> None:
        # gunicorn's own SIGHUP replaces every worker, which cuts the streams open past the graceful timeout; the
        # gateway's settings come from the environment, which a reload would not re-read anyway. What changes
        # at run time is the keys file, and each worker re-reads it on its own SIGHUP (gateway/worker.py).
        server.log.info("SIGHUP: workers re-read SIE_AUTH_TOKENS_FILE")
        server.kill_workers(signal.SIGHUP)

    server.handle_hup = reread_keys_in_every_worker
