"""A fixed CPU probe for `make bench-peer`: how fast this box multiplies one fixed fp32 matrix pair right now.

bench/peer.py times it before each server starts and after it stops, with no server up, so a probe reads the box
and nothing of ours. A box that another job loads for the length of a server run shows as a slower probe on one
side of that run; best-of a few repetitions keeps a single scheduler hiccup from reading as load.

Run alone: `.venv/bin/python -m bench.cpu_probe` prints GFLOP/s.
"""

from __future__ import annotations

import time

PROBE_SIZE = 2048  # 17 GFLOP a product: about 0.1 s on the 2-core AVX-512 box, long enough to see a busy core
PROBE_REPS = 5


def probe_gflops(size: int = PROBE_SIZE, reps: int = PROBE_REPS) -> float:
    """GFLOP/s of the fastest of `reps` fp32 `size` x `size` matrix products (after one untimed warm-up)."""
    import torch  # here, not at import: the rest of the peer bench is a client and needs no torch

    generator = torch.Generator().manual_seed(0)
    a = torch.randn(size, size, generator=generator)
    b = torch.randn(size, size, generator=generator)
    out = torch.empty(size, size)
    torch.mm(a, b, out=out)
    best = float("inf")
    for _ in range(reps):
        t0 = time.perf_counter()
        torch.mm(a, b, out=out)
        best = min(best, time.perf_counter() - t0)
    return 2 * size**3 / best / 1e9


if __name__ == "__main__":
    print(f"cpu_probe_gflops: {probe_gflops():.1f}")
