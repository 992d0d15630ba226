"""Counters and gauges the engine keeps; the Triton glue exports them as custom metrics."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class EngineStats:
    running: int = 0
    kv_tokens: int = 0
    generated_tokens: int = 0
    finished: int = 0
    cancelled: int = 0
    ttfts: list[float] = field(default_factory=list)
    tpot_last: float | None = None  # seconds per output token of the latest finished candidate

    def observe_ttft(self, seconds: float) -> None:
        self.ttfts.append(seconds)
        if len(self.ttfts) > 1024:
            del self.ttfts[:512]
