"""Per-request upstream timeouts: the gateway defaults, replaced by native `options.*_timeout_s`.

A client may ask for more or less time than the defaults, but never more than the operator's
`Settings.max_timeout_s`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from gateway.settings import Settings


@dataclass(frozen=True)
class Timeouts:
    first_chunk_s: float  # to the first token (a blocking request's progress marker counts)
    inter_chunk_s: float  # between streamed deltas (streams only)
    overall_s: float  # the whole request

    @classmethod
    def for_request(cls, settings: Settings, options: dict[str, Any] | None) -> Timeouts:
        options = options or {}

        def pick(key: str, default: float) -> float:
            value = options.get(key)
            return default if value is None else min(float(value), settings.max_timeout_s)

        return cls(
            pick("first_chunk_timeout_s", settings.first_chunk_timeout_s),
            pick("inter_chunk_timeout_s", settings.inter_chunk_timeout_s),
            pick("overall_timeout_s", settings.overall_timeout_s),
        )
