"""A prompt-array request (several engine requests read as one) buffers a bounded number of events for a
slow reader, folding deltas per choice, and never drops text."""

from __future__ import annotations

import asyncio

from gateway.domain import GenerationEvent
from gateway.fanout import FANOUT_BUFFER_EVENTS, FanOutSession

TOKENS = 2000


class FakePart:
    ttft_s = 0.01

    async def events(self):
        for i in range(TOKENS):
            yield GenerationEvent(index=0, text="t", completion_tokens=i + 1)
            await asyncio.sleep(0)
        yield GenerationEvent(index=0, text="", finish_reason="length", completion_tokens=TOKENS)

    async def close(self) -> None:
        return None


async def _read_slowly() -> list[GenerationEvent]:
    session = FanOutSession([FakePart(), FakePart()], n=1)
    events = session.events()
    received = [await events.__anext__()]
    await asyncio.sleep(0.5)  # the reader stalls while both parts produce everything
    received += [event async for event in events]
    return received


def test_slow_reader_gets_folded_deltas_not_an_unbounded_queue():
    received = asyncio.run(_read_slowly())
    assert len(received) <= FANOUT_BUFFER_EVENTS + 4  # not 2 x 2,000 queued events
    for index in (0, 1):
        text = "".join(e.text for e in received if e.index == index)
        assert text == "t" * TOKENS  # nothing dropped, in order
        assert [e.finish_reason for e in received if e.index == index][-1] == "length"
