"""Pieces both generation resources use: routing hints from headers, disconnect signal, SSE headers."""

from __future__ import annotations

import asyncio
import dataclasses

from gateway.domain import GenerationRequest
from gateway.errors import GatewayError
from gateway.router import RoutingHints, parse_engine_pin, parse_machine_profile, parse_pool, parse_remote


def routing_hints(req, greq: GenerationRequest | None, model_profile: str | None) -> RoutingHints:
    """Routing from the headers (and the model's `:profile` suffix); affinity from the body when given.

    Without `greq` (the native route, before its body is read) the affinity key is added later with
    `with_affinity`."""
    parse_engine_pin(req.get_header("X-SIE-Engine"))
    pool = parse_pool(req.get_header("X-SIE-Pool"))
    header_pool, machine_profile = parse_machine_profile(req.get_header("X-SIE-MACHINE-PROFILE"))
    hints = RoutingHints(
        pool=pool or header_pool,
        machine_profile=machine_profile or (model_profile if model_profile not in (None, "default") else None),
        forbid_remote=remote_forbidden(req),
        cache_salt=req.context.tenant.cache_salt,
    )
    req.context.machine_profile = hints.machine_profile or "default"  # the request metrics' label
    return hints if greq is None else with_affinity(hints, greq)


def remote_forbidden(req) -> bool:
    """`X-SIE-Remote: forbid` (every header line read: a repeated one is a 400)."""
    values = [v.decode("latin-1") for k, v in req.scope.get("headers", []) if k.lower() == b"x-sie-remote"]
    return parse_remote(values or None)


def with_affinity(hints: RoutingHints, greq: GenerationRequest) -> RoutingHints:
    return dataclasses.replace(hints, affinity_key=greq.routing_key or greq.prompt_cache_key)


def record_answering_endpoint(req, session) -> None:
    """What the middleware stamps on the answer: `X-SIE-Served-By` (`remote` when any part of the request ran on an
    endpoint configured as remote, else `local`) and, on a buffered answer, `X-SIE-Model-Revision` (the served
    config of the endpoint that answered)."""
    parts = getattr(session, "parts", None) or [session]
    req.context.served_by = "remote" if any(p.endpoint.config.remote for p in parts) else "local"
    first = parts[0]
    req.context.model_revision = first.endpoint.models.get(first.profile.name, first.profile).revision


def set_sse_headers(resp) -> None:
    resp.content_type = "text/event-stream"
    resp.set_header("Cache-Control", "no-cache")
    resp.set_header("X-Accel-Buffering", "no")


async def collect_or_cancel(coro, req):
    """Await a generation's first event (it may wait queued behind others for a long time) or a blocking answer,
    cancelling it (and the Triton request) if the client leaves meanwhile."""
    task = asyncio.ensure_future(coro)
    watch = req.scope.get("sie.watch_disconnect")
    if watch is None:
        return await task
    gone = asyncio.ensure_future(watch())
    try:
        done, _ = await asyncio.wait({task, gone}, return_when=asyncio.FIRST_COMPLETED)
        if task in done:
            return task.result()
        # nobody reads this answer; it ends the request quietly (an escaping CancelledError is
        # logged by the server as a crash) and counts as 499 "client closed request" in metrics
        raise GatewayError("the client closed the request", code="cancelled", status=499)
    finally:
        gone.cancel()
        if not task.done():  # the client left, or this handler itself was cancelled (a worker stopping)
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)  # the Triton call is closed once this returns
