"""Where a decode step's wall time goes, summed per decode batch size, cheap enough to stay on.

A step is cut into laps; each `lap(phase)` charges the time since the previous mark to that phase:

- `loop`: from the end of the previous step to the start of this one (the engine loop taking new requests);
- `schedule`: cancellations, admission and end-of-step bookkeeping;
- `stage`: the step's host inputs (token ids, positions, adapters per row);
- `forward`: the runner's call (its host->device copy, the model, the LM head);
- `sample`: the sampler, with its one device->host copy;
- `outputs`: grammar accept, detokenisation, the stop decision, logprob entries;
- `emit`: retiring finished rows, closing requests and sending the streamed deltas (Triton sends when served).

Only steps that decode and prefill nothing are counted, so the figure for B rows is one pure decode step. On a
GPU, `forward` is the launch and `sample` waits for the device; on the CPU every phase is its own work.
"""

from __future__ import annotations

import time

PHASES = ("loop", "schedule", "stage", "forward", "sample", "outputs", "emit")


class StepTiming:
    def __init__(self) -> None:
        self._laps = dict.fromkeys(PHASES, 0.0)
        self._mark = 0.0
        self._last_end: float | None = None
        self._prefilled = False
        self._sums: dict[int, dict[str, float]] = {}  # decode batch size -> phase -> seconds, and "steps"

    def start(self) -> None:
        now = time.perf_counter()
        self._laps = dict.fromkeys(PHASES, 0.0)
        self._laps["loop"] = now - self._last_end if self._last_end is not None else 0.0
        self._mark, self._prefilled = now, False

    def lap(self, phase: str) -> None:
        now = time.perf_counter()
        self._laps[phase] += now - self._mark
        self._mark = now

    def prefilled(self) -> None:
        """This step ran a prefill: it is not a pure decode step."""
        self._prefilled = True

    def end(self, batch: int) -> None:
        self._last_end = time.perf_counter() if batch else None  # the wait of an idle loop is not loop time
        if not batch or self._prefilled:
            return
        sums = self._sums.setdefault(batch, dict.fromkeys(("steps", *PHASES), 0.0))
        sums["steps"] += 1
        for phase, seconds in self._laps.items():
            sums[phase] += seconds

    def reset(self) -> None:
        self._sums.clear()
        self._last_end = None

    def totals(self) -> dict[str, float]:
        """Seconds per phase, and `steps`, over every pure decode step counted: running totals that only grow
        (short of `reset`), which the served engine exports (engine/triton/metrics.py) from another thread."""
        out = dict.fromkeys(("steps", *PHASES), 0.0)
        for sums in list(self._sums.values()):  # a copy: the engine thread may add a batch size meanwhile
            for key, seconds in list(sums.items()):
                out[key] += seconds
        return out

    def summary(self) -> dict[int, dict[str, float]]:
        """Per decode batch size: milliseconds per step for each phase, `wall` (their sum), `steps`, and
        `outside_forward` (the share of the step that is not the forward)."""
        out: dict[int, dict[str, float]] = {}
        for batch, sums in sorted(self._sums.items()):
            steps = sums["steps"]
            ms = {phase: 1000 * sums[phase] / steps for phase in PHASES}
            wall = sum(ms.values())
            out[batch] = {**ms, "wall": wall, "steps": steps,
                          "outside_forward": (wall - ms["forward"]) / wall if wall else 0.0}
        return out
