"""engine.model.attention: our causal attention kernels (a prefill chunk, a decode step) agree with SDPA, and a
query's output does not depend on the chunk it is in, the cached prefix, the batch, the ISA variant or whether a
prefill or a decode step computes it (bit for bit); through the decoder, a prompt gives the same logits whole,
chunked, after a cached prefix, in a batch or token by token (a tiny random Llama, head_dim 64)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from engine.model import cpu_kernels
from engine.model.attention import chunk_attention, decode_attention, native_supported
from tests.unit.decoder_checks import assert_same_logits_chunked_cached_batched_or_decoded
from tests.unit.tiny_models import tiny_llama

pytestmark = pytest.mark.skipif(not cpu_kernels.available(), reason="our CPU kernels cannot be built here")


def _kernel(q, k, v, start, avx2=False):
    return torch.ops.sie_kernels.causal_attention(q, k, v, start, q.shape[-1] ** -0.5, avx2)


def _sdpa(q, k, v, start):
    n, end = q.shape[0], start + q.shape[0]
    mask = torch.ones(n, end, dtype=torch.bool).tril(diagonal=start)
    out = F.scaled_dot_product_attention(q.transpose(0, 1)[None], k[None, :, :end], v[None, :, :end],
                                         attn_mask=mask, enable_gqa=True)
    return out[0].transpose(0, 1)


@pytest.mark.parametrize(("n", "start", "heads", "kv_heads", "head_dim"), [
    (1, 0, 9, 3, 64), (37, 0, 9, 3, 64), (200, 0, 9, 3, 64), (50, 93, 9, 3, 64),  # SmolLM2's shape
    (1, 300, 9, 3, 64),  # one query after a long prefix
    (70, 20, 4, 4, 128), (33, 5, 14, 2, 64),  # no GQA, head_dim 128; a group of 7
])
def test_kernel_matches_sdpa(n, start, heads, kv_heads, head_dim):
    torch.manual_seed(0)
    q = torch.randn(n, heads, head_dim)
    k, v = torch.randn(kv_heads, start + n + 7, head_dim), torch.randn(kv_heads, start + n + 7, head_dim)
    torch.testing.assert_close(_kernel(q, k, v, start), _sdpa(q, k, v, start), rtol=1e-5, atol=2e-6)
    torch.testing.assert_close(chunk_attention(q, k, v, start, native=True), _sdpa(q, k, v, start),
                               rtol=1e-5, atol=2e-6)


def test_a_query_gives_the_same_bits_in_any_chunk_after_any_prefix_and_on_both_isas():
    """Keys are walked in fixed blocks from position 0 and past a query's position add exact zeros: a prefix-cache
    hit equals a miss, and the AVX2 variant equals the AVX-512 one."""
    torch.manual_seed(0)
    n = 181
    q, k, v = torch.randn(n, 9, 64), torch.randn(3, n, 64), torch.randn(3, n, 64)
    whole = _kernel(q, k, v, 0)
    for start, end in [(0, 1), (0, 50), (50, 51), (50, 181), (17, 100), (180, 181)]:
        assert torch.equal(_kernel(q[start:end], k, v, start), whole[start:end]), (start, end)
    assert torch.equal(_kernel(q, k, v, 0, avx2=True), whole)
    assert torch.equal(_kernel(q[60:], k, v, 60, avx2=True), whole[60:])


def test_strided_queries_and_cache_views_are_read_in_place():
    """The decoder passes q as a view of the fused QKV output and k/v as one slot of the cache."""
    torch.manual_seed(0)
    qkv = torch.randn(40, 15, 64)  # 9 query heads, then 3 key and 3 value heads
    cache = torch.randn(2, 3, 64, 64)  # [slots, Hkv, max_len, D]
    q = qkv[:, :9]
    assert not q.is_contiguous()
    torch.testing.assert_close(_kernel(q, cache[1], cache[0], 10), _sdpa(q.contiguous(), cache[1], cache[0], 10),
                               rtol=1e-5, atol=2e-6)


def _decode_case(seed=0):
    torch.manual_seed(seed)
    positions = torch.tensor([0, 40, 17, 63, 150, 199])  # whole 64-key tiles, a partial one, the cache's end
    q, k, v = torch.randn(6, 9, 64), torch.randn(6, 3, 64), torch.randn(6, 3, 64)
    k_cache, v_cache = torch.randn(7, 3, 200, 64), torch.randn(7, 3, 200, 64)  # [slots, Hkv, L, D]
    return q, k, v, k_cache, v_cache, positions


def test_decode_writes_each_rows_key_and_value_then_matches_sdpa():
    q, k, v, k_cache, v_cache, positions = _decode_case()
    expected_k, expected_v = k_cache.clone(), v_cache.clone()
    for b, p in enumerate(positions.tolist()):
        expected_k[b, :, p], expected_v[b, :, p] = k[b], v[b]
    out = decode_attention(q, k, v, k_cache, v_cache, positions)
    assert torch.equal(k_cache, expected_k) and torch.equal(v_cache, expected_v)  # slot 6 (no row) untouched
    for b, p in enumerate(positions.tolist()):
        ref = _sdpa(q[b : b + 1], k_cache[b, :, : p + 1], v_cache[b, :, : p + 1], p)
        torch.testing.assert_close(out[b : b + 1], ref, rtol=1e-5, atol=2e-6)


def test_a_decode_step_gives_the_bits_the_prefill_gives_and_so_does_avx2():
    q, k, v, k_cache, v_cache, positions = _decode_case()
    out = decode_attention(q, k, v, k_cache, v_cache, positions)
    again = torch.ops.sie_kernels.decode_attention(q, k, v, k_cache.clone(), v_cache.clone(), positions, 0.125, True)
    assert torch.equal(again, out)
    for b, p in enumerate(positions.tolist()):
        queries = torch.randn(p + 1, 9, 64)
        queries[p] = q[b]  # the prefill of the whole slot, this row's query last
        assert torch.equal(_kernel(queries, k_cache[b], v_cache[b], 0)[p], out[b]), b
        assert torch.equal(_kernel(q[b : b + 1], k_cache[b], v_cache[b], p)[0], out[b]), b


def test_bad_shapes_are_refused():
    q, k, v, k_cache, v_cache, positions = _decode_case()
    with pytest.raises(RuntimeError, match="outside the cache"):
        decode_attention(q, k, v, k_cache, v_cache, positions + 1)
    with pytest.raises(RuntimeError, match="multiple of 64"):
        _kernel(torch.randn(4, 4, 32), torch.randn(2, 4, 32), torch.randn(2, 4, 32), 0)
    with pytest.raises(RuntimeError, match="keys 0..start"):
        _kernel(torch.randn(4, 3, 64), torch.randn(1, 5, 64), torch.randn(1, 5, 64), 2)
    with pytest.raises(RuntimeError, match="a slot per row"):
        decode_attention(q, k, v, k_cache[:4], v_cache[:4], positions)


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
@pytest.mark.parametrize("weights", ["float32", "bfloat16"])
def test_decoder_logits_are_the_same_whole_chunked_cached_batched_or_decoded(monkeypatch, weights):
    """With the tiled linears (row-invariant too) every op of the forward is: the bits cannot depend on the
    chunking, the prefix cache or the batch. bf16 weights (where the CPU has AVX512_BF16): the decoder's mixed mode,
    fp32 activations and KV cache, with this fp32 attention kernel (a CPU without AMX; forced on one with it)."""
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
    cache = dec.new_cache(3, 256)
    prompt = torch.randint(0, 256, (150,), generator=torch.Generator().manual_seed(1)).tolist()
    whole = dec.prefill(cache, 0, prompt, 0)
    ref = model(torch.tensor([prompt])).logits[0, -1]
    if weights == "float32":
        torch.testing.assert_close(whole, ref, rtol=1e-4, atol=1e-4)
    else:  # the fp32 model's logits, up to bf16 products
        assert (whole - ref).norm() / ref.norm() < 2e-2
    assert_same_logits_chunked_cached_batched_or_decoded(dec, cache, prompt, whole)
