"""Triton endpoints from DNS: a pool whose `dns: host:port` names a headless Service (one address per ready pod).

The registry re-resolves it every `dns_refresh_s` and adds and drops endpoints as pods come and go. Each address
is its own endpoint (`ip:port`), so rendezvous affinity (scored on that url) moves only the keys of the pods that
changed.
"""

from __future__ import annotations

import asyncio
import logging
import socket
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field

from gateway.settings import EndpointConfig, PoolConfig, split_host_port

log = logging.getLogger(__name__)

# (host, port) -> the addresses it resolves to now; [] when the name exists no more (no ready pod).
# Raises OSError when DNS could not answer (the caller then keeps what it had).
Resolver = Callable[[str, int], Awaitable[list[str]]]

# Answers that mean "this name has no addresses", as opposed to a DNS server that could not answer.
_NO_ADDRESSES = {socket.EAI_NONAME, getattr(socket, "EAI_NODATA", socket.EAI_NONAME)}


async def resolve_dns(host: str, port: int) -> list[str]:
    """The system resolver (getaddrinfo, off the event loop), every address once, in a stable order."""
    try:
        infos = await asyncio.get_running_loop().getaddrinfo(host, port, type=socket.SOCK_STREAM)
    except socket.gaierror as exc:
        if exc.errno in _NO_ADDRESSES:
            return []
        raise
    return sorted({str(info[4][0]) for info in infos})


def endpoint_url(address: str, port: int) -> str:
    return f"[{address}]:{port}" if ":" in address else f"{address}:{port}"


@dataclass
class DnsSource:
    """One pool's DNS name and what it resolved to last."""

    pool: PoolConfig
    resolver: Resolver
    addresses: list[str] = field(default_factory=list)
    resolved_at: float = float("-inf")

    def due(self, now: float) -> bool:
        return now - self.resolved_at >= self.pool.dns_refresh_s

    async def resolve(self) -> list[EndpointConfig] | None:
        """The pool's endpoints now, or None when DNS could not answer (keep the current ones)."""
        assert self.pool.dns is not None
        host, port = split_host_port(self.pool.dns)
        self.resolved_at = time.monotonic()
        try:
            addresses = await self.resolver(host, port)
        except OSError as exc:
            log.warning("could not resolve %s (pool %s): %s; keeping %d endpoints", self.pool.dns, self.pool.name,
                        exc, len(self.addresses))
            return None
        if addresses != self.addresses:
            added, dropped = set(addresses) - set(self.addresses), set(self.addresses) - set(addresses)
            log.info("pool %s: %s resolves to %d addresses (added %s, dropped %s)", self.pool.name, self.pool.dns,
                     len(addresses), sorted(added), sorted(dropped))
        self.addresses = list(addresses)
        return [EndpointConfig(url=endpoint_url(a, port), remote=self.pool.dns_remote, name=f"{host}/{a}")
                for a in addresses]
