"""Attention of one prompt chunk that continues a prefix already in the KV cache, on CPU.

Why not SDPA with a mask: a chunk of n queries at positions start..start+n-1 sees every cached key and, among its
own keys, only the earlier ones. As a boolean [n, start + n] mask that sends SDPA's CPU flash kernel through every
key block, the masked half of the chunk's own block included, and converts the mask on each call. Split in two,
each part runs the kernel at its best:

- the prefix: no mask at all, with GQA folded into the query axis (the query order does not matter without a
  mask, so the group's heads share each key block);
- the chunk's own keys: causal (`is_causal`, top-left aligned, which is right when queries and keys are the same
  n positions), so the kernel skips the blocks above the diagonal.

Each part returns its log-sum-exp, and the two softmaxes merge exactly: out = o_chunk + (o_prefix - o_chunk) *
sigmoid(lse_prefix - lse_chunk). A 1,456-token prompt in 512-token chunks prefilled 3-6 % faster (alternated
runs, SmolLM2 fp32); logits agree with the masked kernel to 3e-5.
"""

from __future__ import annotations

import torch

_FLASH_CPU = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu


def continued_chunk_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, start: int) -> torch.Tensor:
    """q [1, H, n, D] at positions start..start+n-1; k, v [1, Hkv, start + n, D] (H a multiple of Hkv), the
    prefix's keys first. Returns [1, H, n, D], as SDPA with the causal-from-`start` mask would. CPU only."""
    _, heads, n, dim = q.shape
    kv_heads = k.shape[1]
    group = heads // kv_heads
    o_prefix, lse_prefix = _FLASH_CPU(q.reshape(1, kv_heads, group * n, dim), k[:, :, :start], v[:, :, :start],
                                      0.0, False)
    o_prefix, lse_prefix = o_prefix.reshape(1, heads, n, dim), lse_prefix.reshape(1, heads, n)
    own_k = k[:, :, start:].repeat_interleave(group, dim=1)  # n keys per head: small next to the prefix
    own_v = v[:, :, start:].repeat_interleave(group, dim=1)
    o_own, lse_own = _FLASH_CPU(q, own_k, own_v, 0.0, True)
    weight = torch.sigmoid(lse_prefix - lse_own).unsqueeze(-1).to(o_own.dtype)  # the prefix's share of each row
    return torch.lerp(o_own, o_prefix, weight)
