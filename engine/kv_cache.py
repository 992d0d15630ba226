"""Static KV buffers, one row ("slot") per running sequence.

Allocated once; on the host, memory pages are only committed as positions are written.
Running sequences are kept in slots 0..B-1 so a decode step reads plain views, no gathers.
"""

from __future__ import annotations

import torch


class KVCache:
    def __init__(self, layers: int, slots: int, kv_heads: int, max_len: int, head_dim: int, dtype, device) -> None:
        shape = (layers, slots, kv_heads, max_len, head_dim)
        # Masked positions still enter attention as 0 x value, and 0 x NaN is NaN: the cache must never
        # hold stale NaNs. A large host allocation is fresh zeroed pages (committed lazily, as written);
        # device memory is reused, so it is zeroed explicitly.
        alloc = torch.empty if torch.device(device).type == "cpu" else torch.zeros
        self.k = alloc(shape, dtype=dtype, device=device)
        self.v = alloc(shape, dtype=dtype, device=device)
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
