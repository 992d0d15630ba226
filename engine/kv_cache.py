"""Static KV buffers, one row ("slot") per running sequence.

Allocated once with `torch.empty`, so memory pages are only committed as positions are written.
Running sequences are kept in slots 0..B-1 so a decode step reads plain views, no gathers.
"""

from __future__ import annotations

import torch


class KVCache:
    def __init__(self, layers: int, slots: int, kv_heads: int, max_len: int, head_dim: int, dtype, device) -> None:
        shape = (layers, slots, kv_heads, max_len, head_dim)
        self.k = torch.empty(shape, dtype=dtype, device=device)
        self.v = torch.empty(shape, dtype=dtype, device=device)
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
