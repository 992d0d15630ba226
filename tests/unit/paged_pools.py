"""Paged KV pools for the attention kernel tests: rows viewed in place as blocks, or their blocks scattered through a
pool among garbage ones, each with the block table that reads them back in order."""

from __future__ import annotations

import torch


def rows(kv_heads, length, head_dim):
    """Random keys or values [Hkv, L, D], L rounded up to a multiple of 64 (of every block size tested)"""
    return torch.randn(kv_heads, -(-length // 64) * 64, head_dim)


def identity_pools(k, v, block):
    """Rows k, v [Hkv, L, D] viewed in place as pools [L // block, Hkv, block, D] (general strides), read back in
    order by the identity table"""
    def view(rows):
        return rows.unflatten(1, (rows.shape[1] // block, block)).transpose(0, 1)

    return view(k), view(v), torch.arange(k.shape[1] // block)


def shuffled_pools(k, v, block, spare=5, pad=0, seed=0):
    """The blocks of rows k, v [Hkv, L, D] scattered in a random order through fresh pools, among `spare` blocks of
    garbage (large finite values) that no table entry names; `pad` features of garbage after each row's D (a
    position stride past D). Returns the pools and the table that reads k, v back."""
    g = torch.Generator().manual_seed(seed)
    kv_heads, length, d = k.shape
    used = length // block
    table = torch.randperm(used + spare, generator=g)[:used]

    def pool(rows):
        p = torch.randn(used + spare, kv_heads, block, d + pad, generator=g) * 1e30
        p[table, ..., :d] = rows.unflatten(1, (used, block)).transpose(0, 1)
        return p[..., :d]

    return pool(k), pool(v), table
