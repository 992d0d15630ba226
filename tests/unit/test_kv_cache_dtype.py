"""The KV cache's dtype (`kv_cache_dtype`, engine.model.kv_cache): a bf16 pool holds K/V rounded once, at the write
(torch's rounding in `KVCache.write`, the same in our decode kernels' own write), and widened where they are read.
Our attention kernels read bf16 pools in place and give the bits they give over fp32 pools holding the same rounded
values (both ISAs, shuffled block tables, prefill and decode); the SDPA path gathers them widened; the pool costs
half the bytes a token, so a KV memory holds twice the positions."""

from __future__ import annotations

import pytest
import torch

from engine.model import cpu_kernels
from engine.model.attention import chunk_attention, decode_attention
from engine.model.kv_cache import KVCache, kv_dtype_for, kv_tokens_for

from .paged_pools import rows as _rows
from .paged_pools import shuffled_pools as _shuffled_pools

BF16 = torch.bfloat16
kernels = pytest.mark.skipif(not cpu_kernels.available(), reason="our CPU kernels cannot be built here")
bf16_products = pytest.mark.skipif(not (cpu_kernels.available() and torch.ops.sie_kernels.has_avx512_bf16()),
                                   reason="the bf16-product attention kernel runs where the CPU has AVX512_BF16")


def _causal(q, k, v, table, start, avx2=False):
    return torch.ops.sie_kernels.causal_attention(q, k, v, table, start, q.shape[-1] ** -0.5, avx2)


def _pools(n_keys, kv_heads=3, head_dim=64, block=16, seed=0):
    """bf16 pools with shuffled blocks among garbage ones, their table, and the same pools widened to fp32."""
    torch.manual_seed(seed)
    kp, vp, table = _shuffled_pools(_rows(kv_heads, n_keys, head_dim), _rows(kv_heads, n_keys, head_dim), block)
    kb, vb = kp.to(BF16), vp.to(BF16)
    return kb, vb, table, kb.float(), vb.float()


@kernels
@pytest.mark.parametrize("avx2", [False, True])
@pytest.mark.parametrize("block", [16, 32, 64])
@pytest.mark.parametrize(("n", "start", "heads", "kv_heads", "head_dim"), [
    (181, 0, 9, 3, 64), (50, 93, 9, 3, 64), (33, 130, 14, 2, 128), (1, 255, 7, 1, 64)])
def test_the_fp32_kernel_reads_a_bf16_pool_as_its_fp32_widening(n, start, heads, kv_heads, head_dim, block, avx2):
    kb, vb, table, kf, vf = _pools(start + n, kv_heads, head_dim, block)
    q = torch.randn(n, heads, head_dim)
    assert torch.equal(_causal(q, kb, vb, table, start, avx2), _causal(q, kf, vf, table, start, avx2))


@bf16_products
@pytest.mark.parametrize("block", [16, 32, 64])
@pytest.mark.parametrize(("n", "start"), [(181, 0), (50, 93), (1, 255)])
def test_the_bf16_product_kernel_reads_a_bf16_pool_as_the_fp32_pool_it_rounds(n, start, block):
    """The mixed mode rounds an fp32 pool's K/V to bf16 as it reads them: a bf16 pool of those values is the same."""
    kb, vb, table, kf, vf = _pools(start + n, block=block)
    q = torch.randn(n, 9, 64)
    bf16 = chunk_attention(q, kb, vb, table, start, native=True, bf16=True)
    assert torch.equal(bf16, chunk_attention(q, kf, vf, table, start, native=True, bf16=True))


def _decode_pools(block, seed=0):
    """Pools of 5 slots' 192 positions (slot 4 has no row), bf16, with each row's table and position."""
    torch.manual_seed(seed)
    kb, vb, table, _, _ = _pools(5 * 192, block=block, seed=seed)
    tables = table.reshape(5, -1)
    positions = torch.tensor([0, 40, 63, 150])
    q, k, v = torch.randn(4, 9, 64), torch.randn(4, 3, 64), torch.randn(4, 3, 64)
    return q, k, v, kb, vb, tables, positions


@pytest.mark.parametrize("bf16", [pytest.param(False, marks=kernels), pytest.param(True, marks=bf16_products)])
@pytest.mark.parametrize("block", [16, 64])
def test_a_decode_step_writes_rounded_as_torch_rounds_and_gives_the_prefills_bits(block, bf16):
    q, k, v, kb, vb, tables, positions = _decode_pools(block)
    expected_k, expected_v = kb.clone(), vb.clone()
    for row, p in enumerate(positions.tolist()):
        expected_k[tables[row, p // block], :, p % block] = k[row].to(BF16)
        expected_v[tables[row, p // block], :, p % block] = v[row].to(BF16)
    widened = decode_attention(q, k, v, kb.float(), vb.float(), tables, positions, bf16)  # fp32 pools: not rounded
    out = decode_attention(q, k, v, kb, vb, tables, positions, bf16)
    assert torch.equal(kb, expected_k) and torch.equal(vb, expected_v)  # and nothing else written
    if not bf16:  # fp32 math over K/V that this step's keys and values were not rounded in
        assert not torch.equal(out, widened)
        torch.testing.assert_close(out, widened, rtol=2e-2, atol=2e-2)
    for row, p in enumerate(positions.tolist()):
        queries = torch.randn(p + 1, 9, 64)
        queries[p] = q[row]  # the prefill of the whole sequence, this row's query last
        prefill = chunk_attention(queries, kb, vb, tables[row], 0, native=True, bf16=bf16)
        assert torch.equal(prefill[p], out[row]), row
    if not bf16:  # the AVX2 variant: the same writes and bits
        kb2, vb2 = _decode_pools(block)[3:5]
        again = torch.ops.sie_kernels.decode_attention(q, k, v, kb2, vb2, tables, positions, 0.125, True)
        assert torch.equal(again, out) and torch.equal(kb2, kb) and torch.equal(vb2, vb)


@kernels
def test_the_sdpa_fallback_widens_what_it_gathers():
    kb, vb, table, kf, vf = _pools(150)
    q = torch.randn(50, 9, 64)
    sdpa = chunk_attention(q, kb, vb, table, 100, native=False)
    assert sdpa.dtype == torch.float32
    assert torch.equal(sdpa, chunk_attention(q, kf, vf, table, 100, native=False))
    torch.testing.assert_close(sdpa, chunk_attention(q, kb, vb, table, 100, native=True), rtol=1e-5, atol=2e-6)


@kernels
def test_pools_of_two_dtypes_are_refused():
    kb, vb, table, kf, _ = _pools(64)
    with pytest.raises(RuntimeError, match="both alike"):
        _causal(torch.randn(4, 9, 64), kf, vb, table, 0)
    with pytest.raises(RuntimeError, match="both alike"):
        decode_attention(torch.randn(1, 9, 64), torch.randn(1, 3, 64), torch.randn(1, 3, 64), kb.half(), vb.half(),
                         table[None], torch.tensor([3]))


def test_a_bf16_pool_rounds_at_the_write_and_gathers_in_the_activations_dtype():
    cache = KVCache(layers=2, slots=3, kv_heads=2, max_len=64, head_dim=8, dtype=torch.float32, device="cpu",
                    storage=BF16)
    fp32 = KVCache(layers=2, slots=3, kv_heads=2, max_len=64, head_dim=8, dtype=torch.float32, device="cpu")
    assert cache.k.dtype == cache.v.dtype == BF16 and fp32.k.dtype == torch.float32
    assert 2 * cache.bytes_per_token() == fp32.bytes_per_token()
    k, v = torch.randn(40, 2, 8), torch.randn(40, 2, 8)
    block, offset = cache.locate(cache.tables[1], torch.arange(40))
    cache.write(1, block, offset, k, v)
    keys, values = cache.gather(1, cache.tables[[1]], 40)
    assert keys.dtype == values.dtype == torch.float32
    assert torch.equal(keys[0], k.to(BF16).float().transpose(0, 1))
    assert torch.equal(values[0], v.to(BF16).float().transpose(0, 1))


def test_the_profiles_kv_dtype_is_never_wider_than_the_activations():
    assert kv_dtype_for("auto", torch.float32) == torch.float32 and kv_dtype_for("auto", BF16) == BF16
    assert kv_dtype_for("bfloat16", torch.float32) == BF16 and kv_dtype_for("bfloat16", BF16) == BF16
    assert kv_dtype_for("bfloat16", torch.float16) == torch.float16
    with pytest.raises(ValueError, match="kv_cache_dtype"):
        kv_dtype_for("float8", torch.float32)


def test_kv_memory_holds_twice_the_positions_in_bf16():
    cpu = torch.device("cpu")
    memory = 46080 * 10_000  # SmolLM2: 46,080 bytes a token in fp32
    assert kv_tokens_for(memory, 30, 3, 64, kv_dtype_for("auto", torch.float32), cpu) == 10_000
    assert kv_tokens_for(memory, 30, 3, 64, kv_dtype_for("bfloat16", torch.float32), cpu) == 20_000


@torch.inference_mode()
@pytest.mark.parametrize("kv", ["bfloat16", "int8"])
def test_the_transformers_path_writes_and_gathers_a_narrow_cache(kv):
    """Its attention function writes K/V rounded into the pool and gathers them widened, prefill and decode alike."""
    from engine.model.transformers_decoder import TransformersDecoder
    from engine.runner.model_runner import ModelRunner

    from .tiny_models import tiny_llama

    model = tiny_llama(max_position_embeddings=256)
    ids = torch.randint(0, 256, (120,), generator=torch.Generator().manual_seed(1)).tolist()
    reference = model(torch.tensor([ids])).logits[0]
    runner = ModelRunner(TransformersDecoder(model, max_len=256), slots=2, max_len=256, kv_dtype=kv)
    assert runner.cache.k.dtype == getattr(torch, kv)
    chunked = [runner.prefill(0, ids[:64], 0), runner.prefill(0, ids[64:100], 64)]
    stepped = [runner.decode([ids[p]], [p])[0] for p in range(100, 120)]
    for pos, logits in zip([63, 99, *range(100, 120)], chunked + stepped, strict=True):
        ref = reference[pos]
        assert not torch.equal(logits, ref) and (logits - ref).norm() / ref.norm() < 1e-2, pos
    assert runner.cache.k[:, 1:].float().abs().sum() > 0  # the pool holds the sequence's K/V


@torch.inference_mode()
@pytest.mark.parametrize("kv", ["bfloat16", "int8"])
def test_the_plain_torch_path_reads_a_narrow_cache_as_the_kernels_do(monkeypatch, kv):
    """What a GPU (or a CPU without our kernels) runs: writes through `KVCache.write`, SDPA over gathered, widened
    (dequantized) K/V, in prefill, batched prefill and the graph-capturable decode step. Its logits agree with our
    kernels' on a bf16 or int8 cache, and so do the K/V it writes (up to a last bf16 bit or int8 step where the two
    paths' fp32 K/V round apart)."""
    from engine.model.decoder import Decoder
    from engine.runner.model_runner import ModelRunner

    from .tiny_models import tiny_llama

    shape = dict(hidden_size=192, intermediate_size=256, num_attention_heads=3, num_key_value_heads=1,
                 max_position_embeddings=256)
    monkeypatch.setenv("SIE_LINEAR_KERNEL", "mkl")
    monkeypatch.setenv("SIE_ATTENTION", "sdpa")
    plain = Decoder(tiny_llama(**shape), max_len=256)
    monkeypatch.delenv("SIE_ATTENTION")
    ours = Decoder(tiny_llama(**shape), max_len=256)
    assert not plain.native_attention and ours.native_attention == cpu_kernels.available()
    prompt = torch.randint(0, 256, (90,), generator=torch.Generator().manual_seed(1)).tolist()
    results = []
    for dec in (plain, ours):
        runner = ModelRunner(dec, 3, 256, cuda_graphs=True, capture=False, kv_dtype=kv)
        assert runner.cache.k.dtype == getattr(torch, kv)
        logits = [runner.prefill(0, prompt[:50], 0), runner.prefill(0, prompt[50:], 50),
                  *runner.prefill_batch([1, 2], [prompt[:30], prompt[:70]], [None, None]),
                  *runner.decode([5, 6, 7], [90, 30, 70])]
        results.append((torch.stack(logits), runner.cache))
    (plain_logits, plain_cache), (our_logits, our_cache) = results
    tolerance = 1e-4 if kv == "bfloat16" else 1e-3  # int8: a value one step apart moves a logit further
    torch.testing.assert_close(plain_logits, our_logits, rtol=tolerance, atol=tolerance)
    table = plain_cache.tables[[0]]  # slot 0's 91 positions, dequantized
    for plain_rows, our_rows in zip(plain_cache.gather(1, table, 91), our_cache.gather(1, table, 91), strict=True):
        torch.testing.assert_close(plain_rows, our_rows, rtol=1e-2, atol=2e-2)
