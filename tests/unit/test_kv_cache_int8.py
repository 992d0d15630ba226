"""int8 KV (`kv_cache_dtype: int8`, engine.model.kv_cache): each position's keys and values of a KV head are stored as
int8 with one fp32 scale (absmax / 127), quantized once as they are written, the same bits whether `KVCache.write`
(torch) or a decode kernel writes them. Our attention kernels widen the integers in registers and multiply each
score by its key's scale and each probability by its value's: close to attention over the dequantized K/V, and
with the guarantees of the other dtypes (chunking, cached prefix, block placement, both ISAs, decode = prefill)."""

from __future__ import annotations

import pytest
import torch

from engine.model import cpu_kernels
from engine.model.attention import chunk_attention, decode_attention
from engine.model.kv_cache import KVCache, kv_dtype_for, kv_tokens_for, quantize

kernels = pytest.mark.skipif(not cpu_kernels.available(), reason="our CPU kernels cannot be built here")
bf16_products = pytest.mark.skipif(not (cpu_kernels.available() and torch.ops.sie_kernels.has_avx512_bf16()),
                                   reason="the bf16-product attention kernel runs where the CPU has AVX512_BF16")
BOTH = [pytest.param(False, marks=kernels), pytest.param(True, marks=bf16_products)]


def _pools(length, block=16, kv_heads=3, head_dim=64, spare=3, seed=0):
    """int8 pools of `length` positions in shuffled blocks among garbage ones (scales too), their table, and the
    same K/V dequantized into fp32 pools."""
    g = torch.Generator().manual_seed(seed)
    blocks = length // block + spare
    k, v = (torch.randn(blocks, kv_heads, block, head_dim, generator=g) * 3 for _ in range(2))
    (qk, sk), (qv, sv) = quantize(k), quantize(v)
    table = torch.randperm(blocks, generator=g)[: length // block]
    return qk, qv, sk, sv, table, qk.float() * sk[..., None], qv.float() * sv[..., None]


def _attend(q, pools, start, bf16, avx2=False):
    qk, qv, sk, sv, table = pools[:5]
    if avx2:
        return torch.ops.sie_kernels.causal_attention(q, qk, qv, table, start, q.shape[-1] ** -0.5, True,
                                                      k_scale=sk, v_scale=sv)
    return chunk_attention(q, qk, qv, table, start, native=True, bf16=bf16, k_scale=sk, v_scale=sv)


@pytest.mark.parametrize("bf16", BOTH)
@pytest.mark.parametrize(("n", "start"), [(181, 11), (50, 93), (1, 255)])
def test_close_to_attention_over_the_dequantized_values(n, start, bf16):
    pools = _pools(256)
    q = torch.randn(n, 9, 64)
    reference = chunk_attention(q, pools[5], pools[6], pools[4], start, native=False)
    tolerance = 6e-2 if bf16 else 2e-5  # bf16 products (of values 3x test_attention_bf16's), or the scale's order
    torch.testing.assert_close(_attend(q, pools, start, bf16), reference, rtol=tolerance, atol=tolerance)


@pytest.mark.parametrize("bf16", BOTH)
@pytest.mark.parametrize("block", [16, 64])
def test_a_query_gives_the_same_bits_in_any_chunk_any_placement_and_on_both_isas(block, bf16):
    pools = _pools(192, block)
    q = torch.randn(192, 9, 64)
    whole = _attend(q, pools, 0, bf16)
    for start, end in [(0, 1), (0, 50), (50, 51), (50, 192), (17, 100)]:
        assert torch.equal(_attend(q[start:end], pools, start, bf16), whole[start:end]), (start, end)
    contiguous = list(pools)
    order = pools[4]
    for i in (0, 1, 2, 3):  # the same blocks in table order, read by the identity table
        contiguous[i] = pools[i][order]
    contiguous[4] = torch.arange(len(order))
    assert torch.equal(_attend(q, contiguous, 0, bf16), whole)
    if not bf16:
        assert torch.equal(_attend(q, pools, 0, bf16, avx2=True), whole)


@pytest.mark.parametrize("bf16", BOTH)
@pytest.mark.parametrize("block", [16, 64])
def test_a_decode_step_quantizes_as_torch_does_and_gives_the_prefills_bits(block, bf16):
    qk, qv, sk, sv, table, _, _ = _pools(4 * 192, block)
    tables = table.reshape(4, -1)
    positions = torch.tensor([0, 40, 63, 150])
    q, k, v = torch.randn(4, 9, 64), torch.randn(4, 3, 64) * 2, torch.randn(4, 3, 64)
    k[1, 2] = 0.0  # an all-zero row: scale 0
    expected = [t.clone() for t in (qk, qv, sk, sv)]
    for row, p in enumerate(positions.tolist()):
        at = (tables[row, p // block], slice(None), p % block)
        (expected[0][at], expected[2][at]), (expected[1][at], expected[3][at]) = quantize(k[row]), quantize(v[row])
    out = decode_attention(q, k, v, qk, qv, tables, positions, bf16, k_scale=sk, v_scale=sv)
    for got, want in zip((qk, qv, sk, sv), expected, strict=True):  # those rows written, nothing else
        assert torch.equal(got, want)
    for row, p in enumerate(positions.tolist()):
        queries = torch.randn(p + 1, 9, 64)
        queries[p] = q[row]
        prefill = chunk_attention(queries, qk, qv, tables[row], 0, native=True, bf16=bf16, k_scale=sk, v_scale=sv)
        assert torch.equal(prefill[p], out[row]), row


@kernels
def test_scales_come_with_int8_pools_only():
    qk, qv, sk, sv, table, kd, vd = _pools(64)
    q = torch.randn(4, 9, 64)
    with pytest.raises(RuntimeError, match="scales with an int8 pool"):
        chunk_attention(q, qk, qv, table, 0, native=True)
    with pytest.raises(RuntimeError, match="scales with an int8 pool"):
        chunk_attention(q, kd, vd, table, 0, native=True, k_scale=sk, v_scale=sv)
    with pytest.raises(RuntimeError, match="fp32 scales"):
        chunk_attention(q, qk, qv, table, 0, native=True, k_scale=sk.double(), v_scale=sv.double())


def test_an_int8_cache_quantizes_at_the_write_and_dequantizes_at_the_gather():
    cache = KVCache(layers=2, slots=3, kv_heads=2, max_len=64, head_dim=8, dtype=torch.float32, device="cpu",
                    storage=torch.int8)
    assert cache.k.dtype == torch.int8 and cache.k_scale is not None and cache.k_scale.shape == (2, 13, 2, 16)
    assert cache.bytes_per_token() == 2 * 2 * 2 * (8 + 4)
    k, v = torch.randn(40, 2, 8), torch.randn(40, 2, 8)
    block, offset = cache.locate(cache.tables[1], torch.arange(40))
    cache.write(1, block, offset, k, v)
    keys, values = cache.gather(1, cache.tables[[1]], 40)
    for got, x in ((keys, k), (values, v)):
        q, scale = quantize(x)
        assert got.dtype == torch.float32 and torch.equal(got[0], (q.float() * scale[..., None]).transpose(0, 1))
        torch.testing.assert_close(got[0], x.transpose(0, 1), rtol=0, atol=x.abs().max().item() / 127)
    cache.copy_block(int(cache.rows[1, 0]), 12)  # a fork's copy takes the scales along
    assert torch.equal(cache.k_scale[:, 12], cache.k_scale[:, int(cache.rows[1, 0])])


def test_kv_memory_holds_about_four_times_the_positions_in_int8():
    cpu = torch.device("cpu")
    assert kv_dtype_for("int8", torch.float32) == kv_dtype_for("int8", torch.bfloat16) == torch.int8
    memory = 46080 * 10_000  # SmolLM2: 46,080 bytes a token in fp32, 30 x 3 x 2 x (64 + 4) = 12,240 in int8
    assert kv_tokens_for(memory, 30, 3, 64, torch.int8, cpu) == memory // 12_240
