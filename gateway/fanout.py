"""Several prompts as one generation: one engine request per prompt, read back as one set of choices.

The engine already fans one request out into `n` interleaved choices; a request with P prompts becomes P
engine requests of `n` choices each, and choice `j` of prompt `p` is renumbered `p * n + j` (OpenAI's order),
so renderers and `collect` see what they see for a single request with `P * n` choices. Every part is
opened (routed, first event awaited) before the response starts, so a capacity or routing error is still
an ordinary HTTP error; any failure closes every part, and with it every Triton request.
"""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import AsyncGenerator, Sequence
from typing import Any

from gateway.domain import GenerationEvent, GenerationRequest, GenerationResult, Prompt, prompt_fields
from gateway.profile import ModelProfile
from gateway.router import RoutingHints
from gateway.service import GenerationService
from gateway.session import GenerationSession
from gateway.stream_buffer import StreamBuffer

_END = object()
FANOUT_BUFFER_EVENTS = 64


class FanOutSession:
    """Opened parts (one per prompt, `n` choices each) iterated and collected as one generation."""

    def __init__(self, parts: Sequence[GenerationSession], n: int) -> None:
        self.parts = list(parts)
        self.n = n
        # the client waits for every part's first event before it sees anything
        self.ttft_s = max(part.ttft_s for part in self.parts)

    async def events(self) -> AsyncGenerator[GenerationEvent, None]:
        # bounded like a single stream's buffer: a slow reader folds deltas instead of growing the queue
        queue = StreamBuffer(FANOUT_BUFFER_EVENTS)

        async def pump(offset: int, part: GenerationSession) -> None:
            try:
                async for event in part.events():  # each part keeps its own timeouts
                    event.index += offset  # events are fresh per response; renumbering in place is safe
                    await queue.put(event)
                queue.put_terminal(_END)
            except Exception as exc:  # handed to the reader, which stops every part
                queue.put_terminal(exc)

        tasks = [asyncio.create_task(pump(p * self.n, part)) for p, part in enumerate(self.parts)]
        try:
            running = len(tasks)
            while running:
                item = await queue.get()
                if item is _END:
                    running -= 1
                elif isinstance(item, Exception):
                    raise item
                else:
                    yield item
        finally:
            await _cancel(tasks)
            await self.close()

    async def collect(self) -> GenerationResult:
        """Every part's result, choices renumbered; prompt and completion tokens summed over the parts."""
        tasks = [asyncio.ensure_future(part.collect()) for part in self.parts]
        try:
            results = await asyncio.gather(*tasks)
        finally:
            await _cancel(tasks)  # one part failed (or the client left): the others stop too
            await self.close()
        choices = {p * self.n + i: c for p, r in enumerate(results) for i, c in r.choices.items()}
        tpots = [r.tpot_ms for r in results if r.tpot_ms is not None]
        ttfts = [r.ttft_ms for r in results if r.ttft_ms is not None]
        return GenerationResult(
            choices,
            sum(r.prompt_tokens for r in results),
            sum(r.completion_tokens for r in results),
            max(ttfts) if ttfts else None,
            sum(tpots) / len(tpots) if tpots else None,
            sum(r.cached_tokens for r in results),
        )

    async def close(self) -> None:
        for part in self.parts:
            await part.close()


async def _cancel(tasks: Sequence[asyncio.Future[Any]]) -> None:
    for task in tasks:
        task.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)


async def open_prompts(
    service: GenerationService, req: GenerationRequest, prompts: Sequence[Prompt], profile: ModelProfile,
    hints: RoutingHints, request_id: str,
) -> GenerationSession | FanOutSession:
    """Open `req` once per prompt (a single prompt is a plain session, no fan-out cost on the hot path)."""
    if len(prompts) == 1:
        return await service.open(dataclasses.replace(req, **prompt_fields(prompts[0])), profile, hints, request_id)
    tasks = [
        asyncio.ensure_future(
            service.open(dataclasses.replace(req, **prompt_fields(prompt)), profile, hints, f"{request_id}.{p}")
        )
        for p, prompt in enumerate(prompts)
    ]
    try:
        parts = await asyncio.gather(*tasks)
    except BaseException:
        # one part failed to open (capacity, routing, timeout) or the client left: release the opened ones
        await _cancel(tasks)
        for task in tasks:
            if task.done() and not task.cancelled() and task.exception() is None:
                await task.result().close()
        raise
    return FanOutSession(parts, req.n)
