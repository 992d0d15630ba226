"""Causal attention on our CPU kernels (engine/model/kernels/causal_attention.cpp) where they run, torch's SDPA
elsewhere: a sequence's prefill chunk (`chunk_attention`) and a decode step's rows (`decode_attention`).

Both read the paged KV cache: a layer's keys (and values) are one pool of fixed-size blocks [num_blocks, Hkv, B, D]
(B positions a block, a multiple of 16) that every sequence draws from, and a sequence's block table (int64) names
the pool block of each B of its positions: position p is row p % B of block table[p // B]. Why: memory follows
the blocks in use rather than rows of the longest length, and sequences that start alike share blocks
(engine.model.kv_cache). Where a sequence's keys lie in the pool changes no bit of the output: the kernels read
each block in place, in the order of a contiguous row.

The kernels take fp32 activations on the CPU, for head dims that are a multiple of 64 (SmolLM2, Llama, Qwen), and
pools of fp32, bf16 or int8 with its scales (the profile's `kv_cache_dtype`): bf16 and int8 K/V are widened to fp32
in registers as they are read. The SDPA path widens (dequantizes) what it gathers. On a 1.5k-token
prompt they run 1.3x (causal) to 1.45x (a chunk after a cached prefix) faster than SDPA on the 2-core Xeon. A
query's output has the same bits whatever the chunking, the cached prefix, the batch, and whether a prefill or a
decode step computes it (the kernel's header says why).

With bf16 weights on the tiled kernel (the decoder's mixed mode: fp32 activations and KV cache) the products run in
bf16 instead, on AMX tiles or vdpbf16ps (engine/model/kernels/attention_bf16.cpp), with the same guarantees: a
512-token chunk after 1,024 cached tokens 6.2 -> 1.4 ms a layer on the AMX Xeon; decode steps about level.
`SIE_ATTENTION=sdpa` keeps SDPA, `SIE_ATTENTION=fp32` the fp32 kernel in the mixed mode too (for comparisons).
"""

from __future__ import annotations

import os

import torch
import torch.nn.functional as F

from engine.model import cpu_kernels


def native_supported(dtype: torch.dtype, device: torch.device, head_dim: int) -> bool:
    """Whether our kernels run for a model in this dtype, on this device, with this head dim."""
    if os.environ.get("SIE_ATTENTION", "").lower() == "sdpa":
        return False
    return dtype == torch.float32 and device.type == "cpu" and head_dim % 64 == 0 and cpu_kernels.available()


def bf16_supported(weight_dtype: torch.dtype, device: torch.device, head_dim: int) -> bool:
    """Whether a model whose activations are fp32 over `weight_dtype` weights runs its attention products in bf16:
    bf16 weights, our kernels here, and a CPU with AVX512_BF16 (AMX tiles where the CPU and OS give AMX)."""
    if os.environ.get("SIE_ATTENTION", "").lower() == "fp32":
        return False
    return (weight_dtype == torch.bfloat16 and native_supported(torch.float32, device, head_dim)
            and torch.ops.sie_kernels.has_avx512_bf16())


def chunk_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, table: torch.Tensor, start: int,
                    native: bool, bf16: bool = False, k_scale: torch.Tensor | None = None,
                    v_scale: torch.Tensor | None = None) -> torch.Tensor:
    """q [n, H, D] for positions start..start+n-1 of one sequence; k, v one layer's pools [num_blocks, Hkv, B, D],
    `table` the sequence's block table (int64 [>= ceil((start+n) / B)]), through which the pools hold its keys and
    values 0..start+n-1 (the chunk's own already written). Returns [n, H, D]: causal, with GQA (query head h reads
    KV head h // group). `native`: `native_supported(...)` for this model; `bf16`: `bf16_supported(...)`, bf16
    products. `k_scale`, `v_scale`: an int8 pool's scales [num_blocks, Hkv, B] (`KVCache.scales`)."""
    n, d = q.shape[0], q.shape[-1]
    if bf16:
        return torch.ops.sie_kernels.causal_attention_bf16(q, k, v, table, start, d**-0.5, k_scale=k_scale,
                                                           v_scale=v_scale)
    if native:
        return torch.ops.sie_kernels.causal_attention(q, k, v, table, start, d**-0.5, k_scale=k_scale,
                                                      v_scale=v_scale)
    end = start + n
    kv_heads, block = k.shape[1], k.shape[2]
    blocks = table[: -(-end // block)]

    def gathered(pool: torch.Tensor, scales: torch.Tensor | None) -> torch.Tensor:  # rows 0..end-1 [Hkv, end, D]
        rows = pool[blocks] if scales is None else pool[blocks].float() * scales[blocks][..., None]
        return rows.transpose(0, 1).reshape(kv_heads, len(blocks) * block, d)[:, :end].to(q.dtype)

    # causal over the chunk, full over the cached prefix; a fresh prompt needs no mask tensor at all
    mask = torch.ones(n, end, dtype=torch.bool, device=q.device).tril(diagonal=start) if start else None
    out = F.scaled_dot_product_attention(q.transpose(0, 1).unsqueeze(0), gathered(k, k_scale)[None],
                                         gathered(v, v_scale)[None], attn_mask=mask, is_causal=mask is None,
                                         enable_gqa=True)
    return out[0].transpose(0, 1)


def decode_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                     tables: torch.Tensor, positions: torch.Tensor, bf16: bool = False,
                     k_scale: torch.Tensor | None = None, v_scale: torch.Tensor | None = None) -> torch.Tensor:
    """One decode step on our kernel (only where `native_supported`): row b's query q[b] [H, D] at positions[b],
    its block table tables[b] (int64 tables [>= rows, max_blocks], rows any stride apart). Writes k[b], v[b]
    [Hkv, D] into the layer's pools [num_blocks, Hkv, B, D] there (a position no other row of the step reads: the
    rows run in parallel), then attends over the row's keys 0..positions[b]. Returns [rows, H, D]. `bf16`: as
    `chunk_attention`'s (the two must agree, so a decode step gives the bits a prefill would). An int8 pool's
    `k_scale`, `v_scale` get the rows' scales."""
    op = torch.ops.sie_kernels.decode_attention_bf16 if bf16 else torch.ops.sie_kernels.decode_attention
    return op(q, k, v, k_cache, v_cache, tables, positions, q.shape[-1] ** -0.5, k_scale=k_scale, v_scale=v_scale)
