"""Per-key settings on a keys-file line (docs/auth.md, "Per-key limits and priorities"): the priorities a key may ask
for, its tenant's weight in the engine's fair sharing, and its concurrency and tokens-per-minute limits.

They follow the key as `name=value` fields, so a line without any is read exactly as before:

    team-a 91ab02...  priority=-5..5 weight=2 max_concurrent=8 tpm=20000

Values are checked here, once, when the file is read; a bad one fails the file naming the line and the setting
(never the key), and the previous keys stay in force.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass

# the request field's own bounds (gateway/contracts/common.py `Priority`, and the engine's check)
PRIORITY_MIN, PRIORITY_MAX = -1000, 1000
MAX_WEIGHT = 1000.0
_RANGE = re.compile(r"^(-?[0-9]{1,4})(?:\.\.(-?[0-9]{1,4}))?$")
SETTING_NAMES = ("priority", "weight", "max_concurrent", "tpm")


@dataclass(frozen=True)
class KeyPolicy:
    """What one key may do. The default priority range is 0..1000: vLLM's priorities run lower-first, so a key may
    always ask to run later than the default but must be allowed to jump the queue (a negative `priority=`)."""

    priority_min: int = 0
    priority_max: int = PRIORITY_MAX
    weight: float = 1.0  # the tenant's share in the engine's fair sharing, relative to weight-1 tenants
    max_concurrent: int | None = None  # requests of this key in flight at once, per gateway worker; None: no limit
    tpm: int | None = None  # tokens per minute (prompt estimate + completion cap), per gateway worker; None: no limit

    @property
    def limited(self) -> bool:
        return self.max_concurrent is not None or self.tpm is not None


DEFAULT_POLICY = KeyPolicy()
OPEN_POLICY = KeyPolicy(priority_min=PRIORITY_MIN)  # auth off: there is no key to allow or refuse anything


class KeySettingError(ValueError):
    """A setting that cannot be used; the message names the setting, never the line's key."""


def is_setting(field: str) -> bool:
    """Whether a keys-file field is a `name=value` setting (a key or a tenant name never starts with one)."""
    name, sep, _ = field.partition("=")
    return bool(sep) and name in SETTING_NAMES


def parse_key_settings(fields: list[str]) -> KeyPolicy:
    """The policy the `name=value` fields give; each name at most once."""
    values: dict[str, str] = {}
    for field in fields:
        name, sep, value = field.partition("=")
        if not sep or name not in SETTING_NAMES:
            raise KeySettingError(f"expected a setting ({', '.join(SETTING_NAMES)}) after the key, "
                                  f"got a field of {len(field)} characters")
        if name in values:
            raise KeySettingError(f"'{name}' is set twice")
        values[name] = value
    low, high = _priority_range(values["priority"]) if "priority" in values else (0, PRIORITY_MAX)
    return KeyPolicy(
        priority_min=low,
        priority_max=high,
        weight=_weight(values["weight"]) if "weight" in values else 1.0,
        max_concurrent=_count("max_concurrent", values["max_concurrent"]) if "max_concurrent" in values else None,
        tpm=_count("tpm", values["tpm"]) if "tpm" in values else None,
    )


def _priority_range(value: str) -> tuple[int, int]:
    """`LOW..HIGH`, or one value `N` (the key may ask for exactly N, and nothing else)."""
    match = _RANGE.match(value)
    if match is None:
        raise KeySettingError("'priority' must be an integer or a range LOW..HIGH")
    low = int(match[1])
    high = int(match[2]) if match[2] is not None else low
    if not PRIORITY_MIN <= low <= high <= PRIORITY_MAX:
        raise KeySettingError(f"'priority' must satisfy {PRIORITY_MIN} <= LOW <= HIGH <= {PRIORITY_MAX}")
    return low, high


def _weight(value: str) -> float:
    try:
        weight = float(value)
    except ValueError:
        weight = math.nan
    if not (math.isfinite(weight) and 0 < weight <= MAX_WEIGHT):
        raise KeySettingError(f"'weight' must be a number in (0, {MAX_WEIGHT:g}]")
    return weight


def _count(name: str, value: str) -> int:
    if not value.isdigit() or int(value) < 1:
        raise KeySettingError(f"'{name}' must be a positive integer")
    return int(value)
