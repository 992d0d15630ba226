"""The bounded hand-off between a stream's pump (reading Triton) and its writer (the client socket).

A client that reads slowly must not make the gateway hold the whole generation as queued events. Once
`limit` items wait, a new plain delta is folded into the last queued delta of its choice (text, logprobs
and reasoning appended in order), so the queue stops growing while no text is lost; an item that cannot be
folded (a closing event behind a closing event) waits for room, which pushes back on the gRPC stream.
Terminal items (end, error, client gone) always go in at once: nothing follows them.
"""

from __future__ import annotations

import asyncio
import dataclasses
from collections import deque
from typing import Any

from gateway.domain import GenerationEvent


def _foldable(item: Any) -> bool:
    return isinstance(item, GenerationEvent) and item.finish_reason is None and item.tool_calls is None \
        and item.ttft_ms is None


class StreamBuffer:
    def __init__(self, limit: int) -> None:
        self.limit = max(limit, 1)
        self._items: deque[Any] = deque()
        self._readable = asyncio.Event()
        self._writable = asyncio.Event()
        self._copied: set[int] = set()  # ids of queued events that are our own copies (safe to extend)

    def __len__(self) -> int:
        return len(self._items)

    def empty(self) -> bool:
        return not self._items

    async def put(self, event: GenerationEvent) -> None:
        while len(self._items) >= self.limit:
            if self._fold(event):
                return
            self._writable.clear()
            await self._writable.wait()
        self._append(event)

    def put_terminal(self, item: Any) -> None:
        self._append(item)

    def _append(self, item: Any) -> None:
        self._items.append(item)
        self._readable.set()

    def _fold(self, event: GenerationEvent) -> bool:
        if not _foldable(event):
            return False
        for i in range(len(self._items) - 1, -1, -1):
            queued = self._items[i]
            if not isinstance(queued, GenerationEvent) or queued.index != event.index:
                continue
            if not _foldable(queued):
                return False  # text may not jump over its choice's closing event
            if id(queued) not in self._copied:  # the producer's object is not ours to change
                queued = dataclasses.replace(queued, logprobs=list(queued.logprobs or []) or None)
                self._items[i] = queued
                self._copied.add(id(queued))
            queued.text += event.text
            if event.logprobs:
                if queued.logprobs is None:
                    queued.logprobs = []
                queued.logprobs.extend(event.logprobs)
            if event.reasoning:
                queued.reasoning = (queued.reasoning or "") + event.reasoning
            queued.completion_tokens = event.completion_tokens
            queued.prompt_tokens = max(queued.prompt_tokens, event.prompt_tokens)
            return True
        return False

    async def get(self) -> Any:
        while not self._items:
            self._readable.clear()
            await self._readable.wait()
        return self.get_nowait()

    def get_nowait(self) -> Any:
        item = self._items.popleft()
        self._copied.discard(id(item))
        self._writable.set()
        return item
