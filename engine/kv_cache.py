"""Static KV buffers, one row ("slot") per running sequence.

Allocated once, zeroed; on the host, memory pages are only committed as positions are written.
Running sequences are kept in slots 0..B-1 so a decode step reads plain views, no gathers.
"""

from __future__ import annotations

import math

import numpy as np
import torch


def zeroed(shape: tuple[int, ...], dtype: torch.dtype, device) -> torch.Tensor:
    """A zero-filled cache buffer. Masked positions still enter attention as 0 x value, and 0 x NaN is NaN,
    so a cache must never hold stale memory (`torch.empty` can hand back recycled heap memory). On the host
    the zeros come from calloc (numpy), whose large blocks are pages committed only as they are written, so
    a cache sized for every slot's full context costs memory only where sequences have been."""
    if torch.device(device).type != "cpu":
        return torch.zeros(shape, dtype=dtype, device=device)
    nbytes = math.prod(shape) * dtype.itemsize
    return torch.from_numpy(np.zeros(nbytes, dtype=np.uint8)).view(dtype).view(shape)


class KVCache:
    def __init__(self, layers: int, slots: int, kv_heads: int, max_len: int, head_dim: int, dtype, device) -> None:
        shape = (layers, slots, kv_heads, max_len, head_dim)
        self.k = zeroed(shape, dtype, device)
        self.v = zeroed(shape, dtype, device)
        self.slots = slots
        self.max_len = max_len

    def bytes_per_token(self) -> int:
        layers, _, heads, _, dim = self.k.shape
        return 2 * layers * heads * dim * self.k.element_size()

    def copy_slot(self, src: int, dst: int, length: int) -> None:
        """Copy the first `length` positions of slot `src` into slot `dst` (fork or compaction)."""
        if src == dst or length == 0:
            return
        self.k[:, dst, :, :length] = self.k[:, src, :, :length]
        self.v[:, dst, :, :length] = self.v[:, src, :, :length]
