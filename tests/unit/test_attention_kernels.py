"""engine.model.attention: our causal attention kernels (a prefill chunk, a decode step), reading a layer's paged KV
pool through block tables, agree with SDPA, and a query's output does not depend on the chunk it is in, the cached
prefix, the batch, the ISA variant, where the table puts its blocks in the pool or whether a prefill or a decode
step computes it (bit for bit); through the decoder, a prompt gives the same logits whole, chunked, after a cached
prefix, in a batch or token by token (a tiny random Llama, head_dim 64)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from engine.model import cpu_kernels
from engine.model.attention import chunk_attention, decode_attention, native_supported
from tests.unit.decoder_checks import assert_same_logits_chunked_cached_batched_or_decoded
from tests.unit.tiny_models import tiny_llama

from .paged_pools import identity_pools as _identity_pools
from .paged_pools import rows as _rows
from .paged_pools import shuffled_pools as _shuffled_pools

pytestmark = pytest.mark.skipif(not cpu_kernels.available(), reason="our CPU kernels cannot be built here")


def _kernel(q, k, v, table, start, avx2=False):
    return torch.ops.sie_kernels.causal_attention(q, k, v, table, start, q.shape[-1] ** -0.5, avx2)


def _sdpa(q, k, v, start):
    n, end = q.shape[0], start + q.shape[0]
    mask = torch.ones(n, end, dtype=torch.bool).tril(diagonal=start)
    out = F.scaled_dot_product_attention(q.transpose(0, 1)[None], k[None, :, :end], v[None, :, :end],
                                         attn_mask=mask, enable_gqa=True)
    return out[0].transpose(0, 1)


def _paged_rows(k, v, block, spare=5, seed=0):
    """Slots' rows k, v [S, Hkv, L, D] with their blocks shuffled through one pool among garbage ones, and the block
    tables [S, L // block] that read each slot back; the tables' rows lie apart (a slice of a wider tensor)."""
    slots, kv_heads, length, d = k.shape
    per_slot = length // block
    wide_k, wide_v, table = _shuffled_pools(k.transpose(0, 1).flatten(1, 2), v.transpose(0, 1).flatten(1, 2), block,
                                            spare, seed=seed)
    tables = torch.full((slots, per_slot + 3), -1)
    tables[:, :per_slot] = table.reshape(slots, per_slot)
    return wide_k, wide_v, tables[:, :per_slot]


def _gather(pool, table, end):
    """A sequence's rows 0..end-1 [Hkv, end, D] out of a pool through its block table"""
    blocks = table[: -(-end // pool.shape[2])]
    return pool[blocks].transpose(0, 1).flatten(1, 2)[:, :end]


@pytest.mark.parametrize(("n", "start", "heads", "kv_heads", "head_dim"), [
    (1, 0, 9, 3, 64), (37, 0, 9, 3, 64), (200, 0, 9, 3, 64), (50, 93, 9, 3, 64),  # SmolLM2's shape
    (1, 300, 9, 3, 64),  # one query after a long prefix
    (70, 20, 4, 4, 128), (33, 5, 14, 2, 64),  # no GQA, head_dim 128; a group of 7
])
def test_kernel_and_the_sdpa_fallback_match_sdpa(n, start, heads, kv_heads, head_dim):
    """Through a shuffled block table of 16-position blocks; the fallback gathers the table's blocks for SDPA."""
    torch.manual_seed(0)
    q = torch.randn(n, heads, head_dim)
    k, v = _rows(kv_heads, start + n + 7, head_dim), _rows(kv_heads, start + n + 7, head_dim)
    kp, vp, table = _shuffled_pools(k, v, 16)
    ref = _sdpa(q, k, v, start)
    torch.testing.assert_close(_kernel(q, kp, vp, table, start), ref, rtol=1e-5, atol=2e-6)
    torch.testing.assert_close(chunk_attention(q, kp, vp, table, start, native=True), ref, rtol=1e-5, atol=2e-6)
    torch.testing.assert_close(chunk_attention(q, kp, vp, table, start, native=False), ref, rtol=1e-5, atol=2e-6)


def test_a_query_gives_the_same_bits_in_any_chunk_after_any_prefix_and_on_both_isas():
    """Keys are walked in fixed blocks from position 0 and past a query's position add exact zeros: a prefix-cache
    hit equals a miss, and the AVX2 variant equals the AVX-512 one."""
    torch.manual_seed(0)
    n = 181
    q, k, v = torch.randn(n, 9, 64), _rows(3, n, 64), _rows(3, n, 64)
    kp, vp, table = _shuffled_pools(k, v, 16)
    whole = _kernel(q, kp, vp, table, 0)
    for start, end in [(0, 1), (0, 50), (50, 51), (50, 181), (17, 100), (180, 181)]:
        assert torch.equal(_kernel(q[start:end], kp, vp, table, start), whole[start:end]), (start, end)
    assert torch.equal(_kernel(q, kp, vp, table, 0, avx2=True), whole)
    assert torch.equal(_kernel(q[60:], kp, vp, table, 60, avx2=True), whole[60:])


@pytest.mark.parametrize("avx2", [False, True])
@pytest.mark.parametrize("block", [16, 32, 64])
@pytest.mark.parametrize(("n", "start", "heads", "kv_heads", "head_dim", "pad"), [
    (181, 0, 9, 3, 64, 0), (50, 93, 9, 3, 64, 16),  # a group of 3; a position stride past D
    (33, 130, 14, 2, 128, 0), (1, 255, 7, 1, 64, 0),  # a group of 7, head_dim 128; one query at a block's end
])
def test_a_shuffled_block_table_gives_the_bits_of_the_contiguous_layout(n, start, heads, kv_heads, head_dim, pad,
                                                                        block, avx2):
    """Where the blocks lie in the pool, and what the blocks no table names hold, change no bit."""
    torch.manual_seed(0)
    q = torch.randn(n, heads, head_dim)
    k, v = _rows(kv_heads, start + n, head_dim), _rows(kv_heads, start + n, head_dim)
    contiguous = _kernel(q, *_identity_pools(k, v, block), start, avx2)
    assert torch.equal(_kernel(q, *_shuffled_pools(k, v, block, pad=pad), start, avx2), contiguous)


def test_strided_queries_and_pool_views_are_read_in_place():
    """The decoder passes q as a view of the fused QKV output and k/v as one layer's pools of a larger cache."""
    torch.manual_seed(0)
    qkv = torch.randn(40, 15, 64)  # 9 query heads, then 3 key and 3 value heads
    cache = torch.randn(2, 12, 3, 16, 64)  # [k and v, num_blocks, Hkv, B, D]
    table = torch.randperm(12)[:4]
    q = qkv[:, :9]
    assert not q.is_contiguous()
    ref = _sdpa(q.contiguous(), _gather(cache[1], table, 50), _gather(cache[0], table, 50), 10)
    torch.testing.assert_close(_kernel(q, cache[1], cache[0], table, 10), ref, rtol=1e-5, atol=2e-6)


def _decode_case(block=16, seed=0):
    torch.manual_seed(seed)
    positions = torch.tensor([0, 40, 17, 63, 150, 191])  # whole 64-key tiles, a partial one, the table's end
    q, k, v = torch.randn(6, 9, 64), torch.randn(6, 3, 64), torch.randn(6, 3, 64)
    # 7 slots' blocks of 192 positions (slot 6 has no row) in one pool
    k_pool, v_pool, tables = _paged_rows(torch.randn(7, 3, 192, 64), torch.randn(7, 3, 192, 64), block)
    return q, k, v, k_pool, v_pool, tables, positions


@pytest.mark.parametrize("block", [16, 32, 64])
def test_decode_writes_each_rows_key_and_value_then_matches_sdpa(block):
    q, k, v, k_pool, v_pool, tables, positions = _decode_case(block)
    expected_k, expected_v = k_pool.clone(), v_pool.clone()
    for b, p in enumerate(positions.tolist()):
        expected_k[tables[b, p // block], :, p % block] = k[b]
        expected_v[tables[b, p // block], :, p % block] = v[b]
    out = decode_attention(q, k, v, k_pool, v_pool, tables, positions)
    assert torch.equal(k_pool, expected_k) and torch.equal(v_pool, expected_v)  # slot 6, the garbage untouched
    for b, p in enumerate(positions.tolist()):
        ref = _sdpa(q[b : b + 1], _gather(k_pool, tables[b], p + 1), _gather(v_pool, tables[b], p + 1), p)
        torch.testing.assert_close(out[b : b + 1], ref, rtol=1e-5, atol=2e-6)


@pytest.mark.parametrize("block", [16, 32, 64])
def test_a_decode_step_gives_the_bits_the_prefill_gives_and_so_does_avx2(block):
    q, k, v, k_pool, v_pool, tables, positions = _decode_case(block)
    again = torch.ops.sie_kernels.decode_attention(q, k, v, k_pool.clone(), v_pool.clone(), tables, positions, 0.125,
                                                   True)
    out = decode_attention(q, k, v, k_pool, v_pool, tables, positions)
    assert torch.equal(again, out)
    for b, p in enumerate(positions.tolist()):
        queries = torch.randn(p + 1, 9, 64)
        queries[p] = q[b]  # the prefill of the whole sequence, this row's query last
        assert torch.equal(_kernel(queries, k_pool, v_pool, tables[b], 0)[p], out[b]), b
        assert torch.equal(_kernel(q[b : b + 1], k_pool, v_pool, tables[b], p)[0], out[b]), b


def test_bad_shapes_are_refused():
    q, k, v, k_pool, v_pool, tables, positions = _decode_case()
    with pytest.raises(RuntimeError, match="outside its block table"):
        decode_attention(q, k, v, k_pool, v_pool, tables, positions + 1)
    bad = tables.clone()
    bad[4, 150 // 16] = k_pool.shape[0]  # row 4 is at position 150
    with pytest.raises(RuntimeError, match="outside the pool"):
        decode_attention(q, k, v, k_pool, v_pool, bad, positions)
    with pytest.raises(RuntimeError, match="int64 block tables"):
        decode_attention(q, k, v, k_pool, v_pool, tables[:5], positions)
    table = tables[0]
    with pytest.raises(RuntimeError, match="multiple of 64"):
        _kernel(torch.randn(4, 4, 32), k_pool[..., :32], v_pool[..., :32], table, 0)
    with pytest.raises(RuntimeError, match="covering keys"):
        _kernel(torch.randn(4, 9, 64), k_pool, v_pool, table[:2], 30)
    with pytest.raises(RuntimeError, match="int64 block table"):
        _kernel(torch.randn(4, 9, 64), k_pool, v_pool, table.int(), 0)
    with pytest.raises(RuntimeError, match="outside the pool"):
        _kernel(torch.randn(4, 9, 64), k_pool, v_pool, torch.tensor([-1]), 0)
    with pytest.raises(RuntimeError, match="multiple of 16"):
        _kernel(torch.randn(4, 9, 64), k_pool[:, :, :8], v_pool[:, :, :8], table, 0)
    with pytest.raises(RuntimeError, match="same sizes and strides"):
        _kernel(torch.randn(4, 9, 64), k_pool, v_pool.transpose(1, 2).contiguous().transpose(1, 2), table, 0)


def test_native_only_where_it_runs(monkeypatch):
    cpu = torch.device("cpu")
    assert native_supported(torch.float32, cpu, 64) and native_supported(torch.float32, cpu, 128)
    assert not native_supported(torch.bfloat16, cpu, 64)
    assert not native_supported(torch.float32, cpu, 80)
    assert not native_supported(torch.float32, torch.device("meta"), 64)
    monkeypatch.setenv("SIE_ATTENTION", "sdpa")
    assert not native_supported(torch.float32, cpu, 64)


def _tiny_llama():
    # head_dim 64 (our attention kernels' multiple) and a GQA group of 3, as SmolLM2
    return tiny_llama(hidden_size=192, intermediate_size=256, num_attention_heads=3, num_key_value_heads=1,
                      max_position_embeddings=256)


@torch.inference_mode()
@pytest.mark.parametrize("kv", ["auto", "bfloat16", "int8"])
@pytest.mark.parametrize("weights", ["float32", "bfloat16"])
def test_decoder_logits_are_the_same_whole_chunked_cached_batched_or_decoded(monkeypatch, weights, kv):
    """With the tiled linears (row-invariant too) every op of the forward is: the bits cannot depend on the
    chunking, the prefix cache or the batch. bf16 weights (where the CPU has AVX512_BF16): the decoder's mixed mode,
    fp32 activations, with this fp32 attention kernel (a CPU without AMX; forced on one with it). The KV cache in
    fp32 (`auto`), bf16 or int8, which the kernel widens as it reads it: the guarantees hold within each."""
    from engine.model.decoder import Decoder
    from engine.model.tiled_linear import runs

    if weights == "bfloat16" and not runs(torch.bfloat16):
        pytest.skip("bf16 weights run on our tiled kernel only where the CPU has AVX512_BF16")
    monkeypatch.setenv("SIE_LINEAR_KERNEL", "tiled")
    monkeypatch.setenv("SIE_ATTENTION", "fp32")
    model = _tiny_llama()
    dec = Decoder(_tiny_llama().to(getattr(torch, weights)), max_len=256)
    assert dec.native_attention and not dec.bf16_attention and dec.linear_kind == "tiled"
    assert dec.dtype == torch.float32 and dec.weight_dtype == getattr(torch, weights)
    cache = dec.new_cache(3, 256, kv_dtype=kv)
    assert cache.k.dtype == {"auto": torch.float32, "bfloat16": torch.bfloat16, "int8": torch.int8}[kv]
    prompt = torch.randint(0, 256, (150,), generator=torch.Generator().manual_seed(1)).tolist()
    whole = dec.prefill(cache, 0, prompt, 0)
    ref = model(torch.tensor([prompt])).logits[0, -1]
    if kv != "auto":  # K/V rounded to 16 or 8 bits: close to the fp32 model's logits, not its bits
        assert (whole - ref).norm() / ref.norm() < 2e-2
    elif weights == "float32":
        torch.testing.assert_close(whole, ref, rtol=1e-4, atol=1e-4)
    else:  # the fp32 model's logits, up to bf16 products
        assert (whole - ref).norm() / ref.norm() < 2e-2
    assert_same_logits_chunked_cached_batched_or_decoded(dec, cache, prompt, whole)
