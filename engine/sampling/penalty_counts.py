"""Output-token counts of the penalised rows (presence/frequency/repetition penalties), kept on the device.

Why: counts per sequence, each bumped by `counts[token] += 1` as tokens arrive, cost two small kernel launches
per row and token; at 64 rows on a GPU that is about 130 launches a step, more than the rest of the sampler.
Here every row's counts are a row of one buffer owned by the sampler; a step adds the tokens each row gained
since its last step in one staged scatter-add and gathers the step's rows in one indexing op, whatever the
batch size. The scheduler releases a sequence's row when it retires, so the row is reused at once (sequences sit
in reference cycles, which only the cyclic GC would break); rows are also keyed weakly, as a backstop.
"""

from __future__ import annotations

import weakref
from collections.abc import Sequence
from typing import Protocol

import torch

from engine.staging import stage


class CountedRow(Protocol):
    output_ids: list[int]


class PenaltyCounts:
    def __init__(self) -> None:
        self.buffer: torch.Tensor | None = None
        # row object -> [buffer row, output tokens already counted]
        self.rows: weakref.WeakKeyDictionary[CountedRow, list[int]] = weakref.WeakKeyDictionary()

    def release(self, row: CountedRow) -> None:
        """Free the row's buffer row now (its sequence has finished); a row that never was counted is a no-op."""
        self.rows.pop(row, None)

    def update(self, rows: Sequence[CountedRow], vocab: int, dtype: torch.dtype, device: torch.device
               ) -> tuple[torch.Tensor, list[int]]:
        """Count each row's new output tokens; returns the [N, vocab] buffer and each row's row of it."""
        buf = self.buffer
        if buf is None or buf.shape[1] != vocab or buf.dtype != dtype or buf.device != device:
            buf = self.buffer = torch.zeros(max(8, len(rows)), vocab, dtype=dtype, device=device)
            self.rows.clear()
        taken = {entry[0] for entry in self.rows.values()}
        fresh: list[int] = []
        pairs: list[tuple[int, int]] = []
        where: list[int] = []
        for row in rows:
            entry = self.rows.get(row)
            if entry is None:
                if len(taken) == buf.shape[0]:  # full: double it, keeping the live rows' counts
                    buf = self.buffer = torch.cat([buf, torch.zeros_like(buf)])
                free = next(k for k in range(buf.shape[0]) if k not in taken)
                taken.add(free)
                fresh.append(free)
                entry = self.rows[row] = [free, 0]
            ids = row.output_ids
            pairs += [(entry[0], t) for t in ids[entry[1] :]]
            entry[1] = len(ids)
            where.append(entry[0])
        if fresh:  # a reused row still holds a finished sequence's counts
            buf[stage(fresh, torch.long, device)] = 0
        if pairs:
            added = stage(pairs, torch.long, device)
            buf.index_put_((added[:, 0], added[:, 1]), buf.new_ones(len(pairs)), accumulate=True)
        return buf, where

    def gather(self, rows: Sequence[CountedRow], vocab: int, dtype: torch.dtype, device: torch.device
               ) -> torch.Tensor:
        """[len(rows), vocab] counts of each row's output tokens so far (a copy: free to modify)."""
        buf, where = self.update(rows, vocab, dtype, device)
        return buf[stage(where, torch.long, device)]
