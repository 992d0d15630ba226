"""Static KV buffers, one row ("slot") per running sequence.

Allocated once, zeroed; on the host, memory pages are only committed as positions are written. A freed slot's
positions read as zeros again (`release`): its pages stay resident, zeroed, while the resident total is within
`resident_budget` (the engine's KV budget, which admission already lets running requests fill), and go back to
the OS beyond it. So resident memory never ratchets past the budget, and the next prompt in a freed slot writes
to pages already mapped: a first write faults a page in at 5-7 us a 4 KiB page on the 2-core VMs, 90-110 ms of a
1.5k-token prompt's first token in fp32 (72 MB of K/V) when every freed slot gave its pages back.
Running sequences are kept in slots 0..B-1 so a decode step reads plain views, no gathers.
"""

from __future__ import annotations

import ctypes
import math
import mmap

import numpy as np
import torch

_PAGE = mmap.PAGESIZE
_MADV_DONTNEED = 4  # Linux: private anonymous pages are dropped and read as zeros when next touched
_libc = ctypes.CDLL(None, use_errno=True)
_libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]


def give_back(address: int, nbytes: int) -> None:
    """Drop the whole pages inside [address, address + nbytes) of calloc'd host memory: RSS falls, and the
    memory reads as zeros again (the cache's invariant holds)."""
    start = -(-address // _PAGE) * _PAGE
    end = (address + nbytes) // _PAGE * _PAGE
    if end > start and _libc.madvise(start, end - start, _MADV_DONTNEED) != 0:
        raise OSError(ctypes.get_errno(), "madvise(MADV_DONTNEED) failed")


def zeroed(shape: tuple[int, ...], dtype: torch.dtype, device) -> torch.Tensor:
    """A zero-filled cache buffer. Masked positions still enter attention as 0 x value, and 0 x NaN is NaN,
    so a cache must never hold stale memory (`torch.empty` can hand back recycled heap memory). On the host
    the zeros come from calloc (numpy), whose large blocks are pages committed only as they are written, so
    a cache sized for every slot's full context costs memory only where sequences have been."""
    if torch.device(device).type != "cpu":
        return torch.zeros(shape, dtype=dtype, device=device)
    nbytes = math.prod(shape) * dtype.itemsize
    raw = np.zeros(nbytes + _PAGE, dtype=np.uint8)
    start = -raw.ctypes.data % _PAGE  # page-aligned, so `release` can give back whole runs of positions
    return torch.from_numpy(raw[start:start + nbytes]).view(dtype).view(shape)


def commit(buffer: torch.Tensor) -> torch.Tensor:
    """Touch every page of a host buffer from `zeroed` now, so no later write to it pays a page fault.

    Why: a first write to a calloc'd page faults, and on the 2-core VMs that cost 5-7 us a 4 KiB page; storing a
    1.5k-token prompt's K/V in a fresh prefix-cache pool (72 MB in fp32) took 65-128 ms instead of 6, on the path
    to that prompt's first token."""
    if buffer.device.type == "cpu":
        buffer.zero_()
    return buffer


class KVCache:
    def __init__(self, layers: int, slots: int, kv_heads: int, max_len: int, head_dim: int, dtype, device) -> None:
        shape = (layers, slots, kv_heads, max_len, head_dim)
        self.k = zeroed(shape, dtype, device)
        self.v = zeroed(shape, dtype, device)
        self.slots = slots
        self.max_len = max_len
        self._host = self.k.device.type == "cpu"  # device memory is allocated up front and stays
        self.resident_budget = 0  # positions kept resident across slots when freed (0: every freed page goes back)
        self.written = [0] * slots  # per slot: positions 0..written-1 may hold K/V (`mark`)
        self.resident = [0] * slots  # per slot: positions whose pages may be resident

    def mark(self, slot: int, end: int) -> None:
        """Positions up to `end` of `slot` are being written (every writer calls it first: the model runner, the
        prefix cache, `copy_slot`)."""
        self.written[slot] = max(self.written[slot], end)
        self.resident[slot] = max(self.resident[slot], end)

    def release(self, slot: int, keep: int = 0) -> None:
        """`slot` keeps its first `keep` positions and reads zeros past them (a freed or shortened slot): zeroed in
        place while the slots' resident positions are within `resident_budget`, else given back to the OS.

        Without the budget a slot would keep every page its longest sequence ever touched, and over hours the
        cache's resident memory would ratchet up to slots x context (12 GB for SmolLM2's profile)."""
        if not self._host or keep >= self.max_len:
            return
        if self.resident_budget and sum(self.resident) <= self.resident_budget:
            if self.written[slot] > keep:
                self.k[:, slot, :, keep : self.written[slot]].zero_()
                self.v[:, slot, :, keep : self.written[slot]].zero_()
            self.written[slot] = min(self.written[slot], keep)
            return
        self.written[slot] = min(self.written[slot], keep)
        self.resident[slot] = min(self.resident[slot], keep)
        layers, slots, heads, max_len, dim = self.k.shape
        run = max_len * dim * self.k.element_size()  # one (layer, slot, head): contiguous positions
        kept = keep * dim * self.k.element_size()
        for buffer in (self.k, self.v):
            base = buffer.data_ptr()
            for layer in range(layers):
                first = base + ((layer * slots + slot) * heads) * run
                for head in range(heads):
                    give_back(first + head * run + kept, run - kept)

    def release_all(self) -> None:
        """Every slot reads zeros (the engine went idle): zeroed in place within the budget, as `release` does, else
        the whole cache given back in one call a buffer."""
        if not self._host:
            return
        if self.resident_budget and sum(self.resident) <= self.resident_budget:
            for slot in range(self.slots):
                self.release(slot)
            return
        for buffer in (self.k, self.v):
            give_back(buffer.data_ptr(), buffer.numel() * buffer.element_size())
        self.written, self.resident = [0] * self.slots, [0] * self.slots

    def bytes_per_token(self) -> int:
        layers, _, heads, _, dim = self.k.shape
        return 2 * layers * heads * dim * self.k.element_size()

    def copy_slot(self, src: int, dst: int, length: int) -> None:
        """Copy the first `length` positions of slot `src` into slot `dst` (fork or compaction)."""
        if src == dst or length == 0:
            return
        self.mark(dst, length)
        self.k[:, dst, :, :length] = self.k[:, src, :, :length]
        self.v[:, dst, :, :length] = self.v[:, src, :, :length]
