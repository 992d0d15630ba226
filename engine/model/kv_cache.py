"""The KV cache: one pool of fixed-size blocks per layer, and a block table per slot.

A layer's keys (and values) are seen as `[num_blocks, kv_heads, block_size, head_dim]`, FlashInfer's "HND" page
layout (stored head-major: see `KVCache.__init__`); our CPU kernels read any strides of it. A slot is a row of the
running batch; its block table says which pool block holds each of its runs of `block_size` positions: position
p of slot s is block `tables[s, p // block_size]`, offset `p % block_size`. So memory follows the blocks in use,
not `slots x max_len`; sequences that start the same way share blocks (the prefix cache, n/best_of forks) without
copying them; and moving a sequence to another row moves its table, not its K/V. Which block goes where is the
scheduler's business (engine.core.block_pool); this module holds the tensors and the tables.

Block 0 is the null block: table entries no sequence owns point at it, and padded rows (CUDA graphs) write there.
Nothing reads it as a real position: the kernels stop at each row's own length, and the SDPA paths mask what lies
past it.

A new cache gives every slot its own run of blocks when the pool holds them all, so a decoder can be driven without
a scheduler (load-time checks, tests); the scheduler's block pool clears the tables and hands blocks out as
positions are written.

On the host the pool is one zeroed allocation whose pages are committed only where blocks are written, and the
block pool reuses the most recently freed blocks first, so resident memory follows the peak of blocks in use.

The pool's dtype (the profile's `kv_cache_dtype`) may be narrower than the activations': `auto` stores them as they
are, `bfloat16` stores K/V in bf16, half the bytes a token, so the same KV memory holds twice the positions; `int8`
stores them as int8 with an fp32 scale per position and KV head (`k_scale`, `v_scale`, laid out as the pool's rows),
about a quarter of fp32's bytes. Values are rounded once, as they are written (`write`; our decode kernels round the
same way), and widened where they are read (our kernels in registers, `gather` for the SDPA paths), so the math stays
in the activations' dtype. int8's scale is per position, not per block: a block is filled a position at a time, and
a scale that grew with it would requantize what is already there, so a prompt's K/V would depend on its chunking.
"""

from __future__ import annotations

import math

import numpy as np
import torch

NULL_BLOCK = 0

# profile name -> the pool's dtype (None: the activations')
KV_CACHE_DTYPES: dict[str, torch.dtype | None] = {"auto": None, "bfloat16": torch.bfloat16, "int8": torch.int8}


def kv_dtype_for(name: str, activations: torch.dtype) -> torch.dtype:
    """The pool's dtype for a profile's `kv_cache_dtype` and the activations' dtype. A pool is never wider than the
    activations it holds: `bfloat16` under bf16 activations is `auto`."""
    if name not in KV_CACHE_DTYPES:
        raise ValueError(f"kv_cache_dtype must be one of {', '.join(KV_CACHE_DTYPES)}, not {name!r}")
    chosen = KV_CACHE_DTYPES[name]
    return activations if chosen is None or chosen.itemsize >= activations.itemsize else chosen


def zeroed(shape: tuple[int, ...], dtype: torch.dtype, device) -> torch.Tensor:
    """A zero-filled buffer. On the host the zeros come from calloc (numpy), whose large blocks are pages committed
    only as they are written, so a pool sized for the profile's whole KV memory costs memory only where blocks have
    been used. (`torch.empty` could hand back recycled heap memory, and a NaN there would survive a masked SDPA as
    0 x NaN.)"""
    if torch.device(device).type != "cpu":
        return torch.zeros(shape, dtype=dtype, device=device)
    nbytes = math.prod(shape) * dtype.itemsize
    return torch.from_numpy(np.zeros(nbytes, dtype=np.uint8)).view(dtype).view(shape)


def blocks_for(positions: int, block_size: int) -> int:
    return -(-positions // block_size)


def free_memory(device: torch.device) -> int:
    """Bytes the device has free now: the GPU's, or the host's available memory (`MemAvailable`)."""
    if device.type == "cuda":
        return torch.cuda.mem_get_info(device)[0]
    with open("/proc/meminfo", encoding="ascii") as f:
        for line in f:
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("no MemAvailable in /proc/meminfo")


def kv_bytes_per_token(layers: int, kv_heads: int, head_dim: int, dtype: torch.dtype) -> int:
    """K and V of one position in every layer, stored as `dtype` (int8: with its fp32 scale per KV head)."""
    row = head_dim * dtype.itemsize + (4 if dtype == torch.int8 else 0)
    return 2 * layers * kv_heads * row


def quantize(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [..., D] as int8 and a scale per row [...]: absmax / 127, each value divided by it and rounded to nearest
    even (a zero row: scale 0, zeros). Our decode kernels quantize with the same operations in the same order
    (engine/model/kernels/paged_rows.h), so a position holds the same bits whichever wrote it."""
    x = x.float()
    scale = x.abs().amax(-1) / 127
    q = torch.where(scale[..., None] > 0, x / scale[..., None], 0).round().clamp(-127, 127)
    return q.to(torch.int8), scale


def kv_tokens_for(memory: int | float, layers: int, kv_heads: int, head_dim: int, dtype: torch.dtype,
                  device: torch.device) -> int:
    """The positions `memory` holds with K/V stored in `dtype` (the pool's, `kv_dtype_for`): bytes (an int), or a
    fraction (a float) of what the device has free now, as vLLM's `gpu_memory_utilization` and
    `VLLM_CPU_KVCACHE_SPACE` size its KV cache."""
    per_token = kv_bytes_per_token(layers, kv_heads, head_dim, dtype)
    size = int(free_memory(device) * memory) if isinstance(memory, float) else memory
    tokens = size // per_token
    if tokens < 1024:
        raise ValueError(f"KV memory of {size} bytes holds {tokens} positions at {per_token} bytes each: too few")
    return tokens


class KVCache:
    def __init__(self, layers: int, slots: int, kv_heads: int, max_len: int, head_dim: int, dtype, device,
                 num_blocks: int | None = None, block_size: int = 16, storage: torch.dtype | None = None) -> None:
        """`dtype`: the activations' (what `write` takes and `gather` returns); `storage`: the pool's (None: the
        same). `num_blocks`: the pool's blocks, the null block included (None: enough for every slot's whole
        context)."""
        self.dtype = dtype
        self.storage = storage or dtype
        self.block_size = block_size
        self.slots = slots
        self.max_len = max_len
        self.max_blocks = blocks_for(max_len, block_size)  # a table's width
        whole = slots * self.max_blocks + 1
        self.num_blocks = whole if num_blocks is None else num_blocks
        # stored head-major, [layers, kv_heads, blocks, B, D], and seen as [layers, blocks, kv_heads, B, D]: one head's
        # consecutive blocks are then consecutive in memory, so where a sequence's table holds a run of them (a
        # prompt's blocks are taken in one go) the kernels read its keys and values as one span
        shape = (layers, kv_heads, self.num_blocks, block_size, head_dim)
        self.k = zeroed(shape, self.storage, device).transpose(1, 2)
        self.v = zeroed(shape, self.storage, device).transpose(1, 2)
        # int8: a scale per position and KV head, [layers, blocks, kv_heads, B], stored head-major as the pools are
        self.k_scale: torch.Tensor | None = None
        self.v_scale: torch.Tensor | None = None
        if self.storage == torch.int8:
            self.k_scale = zeroed(shape[:-1], torch.float32, device).transpose(1, 2)
            self.v_scale = zeroed(shape[:-1], torch.float32, device).transpose(1, 2)
        self.device = self.k.device
        self._host = self.device.type == "cpu"
        # the tables live on the host, where the scheduler writes them (through `rows`, a numpy view: an element
        # write costs ~100 ns there, against ~2 us through torch); a device forward reads a copy (`device_tables`)
        self.tables = torch.zeros(slots, self.max_blocks, dtype=torch.long, device="cpu")
        self.rows = self.tables.numpy()
        if self.num_blocks >= whole:
            self.give_slots_blocks(slots, max_len)

    def give_slots_blocks(self, slots: int, positions: int) -> None:
        """Slots 0..slots-1 each own a run of blocks for their first `positions` positions: how a decoder is driven
        without a scheduler (load-time checks, tests, benchmarks of the forward alone)."""
        count = blocks_for(positions, self.block_size)
        if slots * count >= self.num_blocks:
            raise ValueError(f"{slots} slots of {positions} positions need more than the pool's {self.num_blocks} "
                             "blocks")
        self.rows[:slots] = NULL_BLOCK
        self.rows[:slots, :count] = 1 + np.arange(slots * count).reshape(slots, count)

    def clear_tables(self) -> None:
        """Every entry to the null block: from now on a scheduler hands blocks out."""
        self.rows[:] = NULL_BLOCK

    def device_tables(self, first: int, stop: int) -> torch.Tensor:
        """Tables of slots first..stop-1 where the forward runs: a view on the host, a copy on a device."""
        rows = self.tables[first:stop]
        return rows if self._host else rows.to(self.device, non_blocking=True)

    def tables_of(self, slots: list[int]) -> torch.Tensor:
        """Tables of these slots [len(slots), max_blocks] where the forward runs."""
        rows = self.tables[slots]
        return rows if self._host else rows.to(self.device, non_blocking=True)

    def locate(self, tables: torch.Tensor, positions: torch.Tensor, rows: torch.Tensor | None = None
               ) -> tuple[torch.Tensor, torch.Tensor]:
        """(block, offset) of each position [N]: in one table [max_blocks], or in `tables` [R, max_blocks] by each
        position's row (`rows` [N]; None: position i is in row i)."""
        index = torch.div(positions, self.block_size, rounding_mode="floor")
        if tables.dim() == 1:
            block = tables[index]
        elif rows is None:
            block = tables.gather(1, index[:, None])[:, 0]
        else:
            block = tables[rows, index]
        return block, positions % self.block_size

    def write(self, layer: int, block: torch.Tensor, offset: torch.Tensor, k: torch.Tensor, v: torch.Tensor
              ) -> None:
        """k, v [N, kv_heads, D] into the layer's pool at (block, offset) [N] (no host sync: graph-capturable),
        rounded to the pool's dtype (nearest even, as our decode kernels round what they write)."""
        if self.k_scale is not None and self.v_scale is not None:
            (qk, sk), (qv, sv) = quantize(k), quantize(v)
            self.k[layer][block, :, offset], self.k_scale[layer][block, :, offset] = qk, sk
            self.v[layer][block, :, offset], self.v_scale[layer][block, :, offset] = qv, sv
            return
        self.k[layer][block, :, offset] = k.to(self.storage)
        self.v[layer][block, :, offset] = v.to(self.storage)

    def scales(self, layer: int) -> dict[str, torch.Tensor]:
        """The layer's int8 scales as our attention ops take them (`k_scale`, `v_scale`); none for other pools."""
        if self.k_scale is None or self.v_scale is None:
            return {}
        return {"k_scale": self.k_scale[layer], "v_scale": self.v_scale[layer]}

    def gather(self, layer: int, tables: torch.Tensor, span: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Positions 0..span-1 of each table's sequence, as contiguous rows in the activations' dtype: tables
        [R, >= blocks(span)] -> k, v [R, kv_heads, span, D]. For the SDPA paths; our kernels read the blocks in
        place."""
        count = blocks_for(span, self.block_size)
        index = tables[:, :count]
        out = []
        for pool, scales in ((self.k[layer], self.k_scale), (self.v[layer], self.v_scale)):
            blocks = pool[index]  # [R, count, Hkv, B, D]
            if scales is not None:
                blocks = blocks.float() * scales[layer][index][..., None]
            out.append(blocks.transpose(1, 2).flatten(2, 3)[:, :, :span].to(self.dtype))
        return out[0], out[1]

    def copy_block(self, src: int, dst: int) -> None:
        """Block `dst` takes `src`'s K/V in every layer (a fork's copy of a partly filled block)."""
        for pool in (self.k, self.v, self.k_scale, self.v_scale):
            if pool is not None:
                pool[:, dst] = pool[:, src]

    def bytes_per_token(self) -> int:
        layers, _, heads, _, dim = self.k.shape
        return kv_bytes_per_token(layers, heads, dim, self.storage)
