"""Server-sent events as the tests read them: whole bodies with their framing checked, or lines as they arrive."""

from __future__ import annotations

import json
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import Any

DONE = "[DONE]"
_DATA = "data: "
_EVENT = "event: "


@dataclass
class Comment:
    text: str


def parse_sse(body: str) -> list[Any]:
    """Events in order: decoded JSON payloads, the string "[DONE]", or Comment for `:` lines.

    Also checks the framing the SDK relies on: only `data:` and comment lines, blank-line separated.
    """
    items: list[Any] = []
    assert body.endswith("\n\n"), body[-80:]
    for block in body.split("\n\n")[:-1]:
        lines = block.split("\n")
        assert len(lines) == 1, f"one line per event, got {lines!r}"
        line = lines[0]
        if line.startswith(":"):
            items.append(Comment(line[1:].strip()))
            continue
        assert line.startswith(_DATA), line
        data = line[len(_DATA):]
        items.append(DONE if data == DONE else json.loads(data))
    return items


def data_events(items: list[Any]) -> list[Any]:
    """`parse_sse`'s items without the comments (keep-alives)."""
    return [i for i in items if not isinstance(i, Comment)]


def parse_named_sse(body: str) -> list[dict[str, Any]]:
    """`event: <type>` + `data: <json>` blocks (comments skipped); the event name must match `type`.

    The Responses stream's framing: no `[DONE]` anywhere, every event named after its own `type`.
    """
    events = []
    for block in body.split("\n\n"):
        lines = [line for line in block.split("\n") if line and not line.startswith(":")]
        if not lines:
            continue
        assert len(lines) == 2 and lines[0].startswith(_EVENT) and lines[1].startswith(_DATA), block
        event = json.loads(lines[1][len(_DATA):])
        assert event["type"] == lines[0][len(_EVENT):], block
        events.append(event)
    assert DONE not in body
    return events


def data_payloads(lines: Iterable[str]) -> Iterator[str]:
    """The raw payloads of the `data: ` lines among `lines` (e.g. `httpx.Response.iter_lines()`), as they arrive.

    Lazy, so a test can act part-way through a live stream and then read on from the same iterator.
    """
    for line in lines:
        if line.startswith(_DATA):
            yield line[len(_DATA):]
