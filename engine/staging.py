"""Host data (Python lists of ids, positions, settings) onto the step's device without a host sync.

Why: a plain `.to("cuda")` (or `torch.tensor(data, device="cuda")`) copies from pageable memory and then waits
for the stream, so the host stalls until every kernel already queued (the whole forward) has run, and the
sampler's launches no longer overlap the GPU's work. Staging in pinned memory (torch's caching host allocator
reuses those blocks and keeps each one until its copy has completed) lets the copy queue behind the forward.
On the host this is a plain tensor.
"""

from __future__ import annotations

import torch


def stage(data, dtype: torch.dtype, device: torch.device | str) -> torch.Tensor:
    """`data` (nested lists of numbers) as a tensor on `device`, copied without synchronising the host."""
    host = torch.tensor(data, dtype=dtype, device="cpu")
    if torch.device(device).type != "cuda":
        return host.to(device)
    return host.pin_memory().to(device, non_blocking=True)


def row_index(rows: list[int], total: int, device: torch.device | str) -> slice | torch.Tensor:
    """An index of `rows` (sorted, distinct) among `total`: a slice when it is all of them (no copy at all)."""
    if len(rows) == total:
        return slice(None)
    return stage(rows, torch.long, device)
