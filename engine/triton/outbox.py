"""Coalescing of queued responses: when the sender thread falls behind, consecutive deltas of the same
choice go out as one response (a Triton send costs ~0.2-0.4 ms, so under load this keeps the sender
from becoming the bottleneck). Closing, final and error outputs are never merged or reordered."""

from __future__ import annotations

from typing import Any

from engine.request import RequestOutput


def _mergeable(out: RequestOutput) -> bool:
    return out.error is None and out.finish_reason is None and not out.final


def coalesce(batch: list[tuple[Any, RequestOutput]]) -> list[tuple[Any, RequestOutput]]:
    """Merge runs of plain deltas per (sender, choice index), keeping every request's order."""
    merged: list[tuple[Any, RequestOutput]] = []
    open_slots: dict[tuple[int, int], int] = {}
    for sender, out in batch:
        key = (id(sender), out.index)
        if _mergeable(out):
            if key in open_slots:
                prev = merged[open_slots[key]][1]
                prev.text += out.text
                if out.reasoning:
                    prev.reasoning = (prev.reasoning or "") + out.reasoning
                if out.logprobs:
                    prev.logprobs = (prev.logprobs or []) + out.logprobs
                prev.completion_tokens = out.completion_tokens
                continue
            open_slots[key] = len(merged)
        else:
            # nothing of this request may jump over its closing output
            for stale in [k for k in open_slots if k[0] == id(sender)]:
                del open_slots[stale]
        merged.append((sender, out))
    return merged
