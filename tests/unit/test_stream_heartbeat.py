"""A preempted request's heartbeat (an empty engine output, docs/kv-memory.md) resets the gateway's timers but never
reaches the client as a chunk."""

from __future__ import annotations

import asyncio
from typing import Any

from gateway.domain import GenerationEvent
from gateway.streaming import sse_stream


class Recorder:
    def __init__(self) -> None:
        self.seen: list[GenerationEvent] = []

    def on_event(self, event: GenerationEvent) -> list[dict[str, Any]]:
        self.seen.append(event)
        return [{"text": event.text}] if event.text else []

    def usage_chunk(self) -> dict[str, Any] | None:
        return None

    def error_chunk(self, error) -> dict[str, Any]:
        return {"error": error.code}


def test_heartbeats_are_not_rendered():
    async def events():
        yield GenerationEvent(index=0, text="a")
        yield GenerationEvent(index=0, text="")  # the engine's heartbeat while preempted
        yield GenerationEvent(index=0, text="b", finish_reason="stop", completion_tokens=2)

    async def run() -> bytes:
        renderer = Recorder()
        out = b"".join([part async for part in sse_stream(events(), renderer, 30.0, None)])
        assert [e.text for e in renderer.seen] == ["a", "b"]
        return out

    body = asyncio.run(run())
    assert body == b'data: {"text":"a"}\n\ndata: {"text":"b"}\n\ndata: [DONE]\n\n'
