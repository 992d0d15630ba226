"""engine/model/kernels/attention_bf16.cpp: causal attention with bf16 products (the bf16 profile's mixed mode), on
AMX tiles or vdpbf16ps, whichever this CPU has, reading a layer's paged KV pool through block tables, is as close to
fp32 SDPA as bf16 products allow, and keeps the fp32 kernel's guarantees bit for bit: a query's output does not
depend on its chunk, the cached prefix, the batch or where the table puts its blocks, and a decode step gives the
bits a prefill gives; through the decoder, a prompt's logits are the same whole, chunked, cached, batched or
decoded."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from engine.model import cpu_kernels
from engine.model.attention import bf16_supported, chunk_attention, decode_attention
from tests.unit.decoder_checks import assert_same_logits_chunked_cached_batched_or_decoded
from tests.unit.tiny_models import tiny_llama

from .paged_pools import identity_pools as _identity_pools
from .paged_pools import rows as _rows
from .paged_pools import shuffled_pools as _shuffled_pools

pytestmark = pytest.mark.skipif(not (cpu_kernels.available() and torch.ops.sie_kernels.has_avx512_bf16()),
                                reason="the bf16 attention kernel runs where the CPU has AVX512_BF16")

CPU = torch.device("cpu")


def _kernel(q, k, v, table, start):
    return chunk_attention(q, k, v, table, start, native=True, bf16=True)


def _reference(q, k, v, start):
    """fp64 attention over the inputs rounded as the kernel rounds them (q scaled first)."""
    def rounded(t):
        return t.to(torch.bfloat16).double()

    d, n, end = q.shape[-1], q.shape[0], start + q.shape[0]
    mask = torch.ones(n, end, dtype=torch.bool).tril(diagonal=start)
    out = F.scaled_dot_product_attention(rounded(q * d**-0.5).transpose(0, 1)[None], rounded(k[None, :, :end]),
                                         rounded(v[None, :, :end]), attn_mask=mask, scale=1.0, enable_gqa=True)
    return out[0].transpose(0, 1).float()


def _gather(pool, table, end):
    """A sequence's rows 0..end-1 [Hkv, end, D] out of a pool through its block table"""
    blocks = table[: -(-end // pool.shape[2])]
    return pool[blocks].transpose(0, 1).flatten(1, 2)[:, :end]


@pytest.mark.parametrize(("n", "start", "heads", "kv_heads", "head_dim"), [
    (1, 0, 9, 3, 64), (37, 0, 9, 3, 64), (200, 0, 9, 3, 64), (50, 93, 9, 3, 64),  # SmolLM2's shape
    (1, 300, 9, 3, 64), (70, 20, 4, 4, 128), (33, 5, 14, 2, 64), (40, 3, 8, 1, 256),  # no GQA; a group of 7; D 256
])
def test_close_to_attention_over_the_bf16_rounded_inputs(n, start, heads, kv_heads, head_dim):
    """What is left is P's rounding to bf16 (8 bits): well under 1 % of the output. Through a shuffled table of
    16-position blocks, where each 32-key block of P.V spans two pool blocks."""
    torch.manual_seed(0)
    q = torch.randn(n, heads, head_dim)
    k, v = _rows(kv_heads, start + n + 7, head_dim), _rows(kv_heads, start + n + 7, head_dim)
    got, ref = _kernel(q, *_shuffled_pools(k, v, 16), start), _reference(q, k, v, start)
    assert (got - ref).norm() / ref.norm() < 4e-3
    torch.testing.assert_close(got, ref, rtol=2e-2, atol=2e-2)


def test_a_query_gives_the_same_bits_in_any_chunk_after_any_prefix():
    torch.manual_seed(0)
    n = 181
    q, k, v = torch.randn(n, 9, 64), _rows(3, n, 64), _rows(3, n, 64)
    kp, vp, table = _shuffled_pools(k, v, 16)
    whole = _kernel(q, kp, vp, table, 0)
    for start, end in [(0, 1), (0, 50), (50, 51), (50, 181), (17, 100), (31, 33), (180, 181)]:
        assert torch.equal(_kernel(q[start:end], kp, vp, table, start), whole[start:end]), (start, end)


@pytest.mark.parametrize("block", [16, 32, 64])
@pytest.mark.parametrize(("n", "start", "heads", "kv_heads", "head_dim", "pad"), [
    (181, 0, 9, 3, 64, 0), (50, 93, 9, 3, 64, 16),  # a group of 3; a position stride past D
    (33, 130, 14, 2, 128, 0), (1, 255, 7, 1, 64, 0),  # a group of 7, head_dim 128; one query at a block's end
])
def test_a_shuffled_block_table_gives_the_bits_of_the_contiguous_layout(n, start, heads, kv_heads, head_dim, pad,
                                                                        block):
    """Where the blocks lie in the pool, and what the blocks no table names hold, change no bit."""
    torch.manual_seed(0)
    q = torch.randn(n, heads, head_dim)
    k, v = _rows(kv_heads, start + n, head_dim), _rows(kv_heads, start + n, head_dim)
    contiguous = _kernel(q, *_identity_pools(k, v, block), start)
    assert torch.equal(_kernel(q, *_shuffled_pools(k, v, block, pad=pad), start), contiguous)


@pytest.mark.parametrize("block", [16, 32, 64])
def test_a_decode_step_writes_its_key_and_value_and_gives_the_prefills_bits(block):
    torch.manual_seed(0)
    positions = torch.tensor([0, 31, 32, 40, 63, 150, 191])  # either side of 32-key blocks, the table's end
    b, length = len(positions), 192
    q, k, v = torch.randn(b, 9, 64), torch.randn(b, 3, 64), torch.randn(b, 3, 64)
    # b + 1 sequences' blocks (the last has no row) in one pool, the tables' rows a slice of a wider tensor
    k_pool, v_pool, table = _shuffled_pools(torch.randn(3, (b + 1) * length, 64), torch.randn(3, (b + 1) * length, 64),
                                            block)
    tables = torch.full((b + 1, length // block + 2), -1)
    tables[:, : length // block] = table.reshape(b + 1, -1)
    tables = tables[:, : length // block]
    for row, p in enumerate(positions.tolist()):  # what a row's blocks hold past its position never reaches the output
        past = torch.arange(p + 1, length)
        k_pool[tables[row, past // block], :, past % block] = float("nan")
        v_pool[tables[row, past // block], :, past % block] = float("nan")
    expected_k, expected_v = k_pool.clone(), v_pool.clone()
    for row, p in enumerate(positions.tolist()):
        expected_k[tables[row, p // block], :, p % block] = k[row]
        expected_v[tables[row, p // block], :, p % block] = v[row]
    out = decode_attention(q, k, v, k_pool, v_pool, tables, positions, bf16=True)
    assert not out.isnan().any()
    # each row's key and value at its position, nothing else written (the last sequence's blocks, the garbage)
    torch.testing.assert_close(k_pool, expected_k, rtol=0, atol=0, equal_nan=True)
    torch.testing.assert_close(v_pool, expected_v, rtol=0, atol=0, equal_nan=True)
    for row, p in enumerate(positions.tolist()):
        queries = torch.randn(p + 1, 9, 64)
        queries[p] = q[row]  # the prefill of the whole sequence, this row's query last
        assert torch.equal(_kernel(queries, k_pool, v_pool, tables[row], 0)[p], out[row]), row
        assert torch.equal(_kernel(q[row : row + 1], k_pool, v_pool, tables[row], p)[0], out[row]), row
        ref = _reference(q[row : row + 1], _gather(k_pool, tables[row], p + 1), _gather(v_pool, tables[row], p + 1), p)
        torch.testing.assert_close(out[row], ref[0], rtol=2e-2, atol=2e-2)


def test_bad_shapes_are_refused():
    k_pool, v_pool, table = _shuffled_pools(torch.randn(3, 64, 64), torch.randn(3, 64, 64), 16)
    with pytest.raises(RuntimeError, match="multiple of 32"):
        _kernel(torch.randn(4, 9, 48), k_pool[..., :48], v_pool[..., :48], table, 0)
    with pytest.raises(RuntimeError, match="covering keys"):
        _kernel(torch.randn(4, 9, 64), k_pool, v_pool, table[:2], 30)
    with pytest.raises(RuntimeError, match="outside the pool"):
        _kernel(torch.randn(4, 9, 64), k_pool, v_pool, torch.tensor([k_pool.shape[0]]), 0)
    with pytest.raises(RuntimeError, match="multiple of 16"):
        _kernel(torch.randn(4, 9, 64), k_pool[:, :, :8], v_pool[:, :, :8], table, 0)
    q, k, v = torch.randn(2, 9, 64), torch.randn(2, 3, 64), torch.randn(2, 3, 64)
    tables = table.reshape(2, 2)
    with pytest.raises(RuntimeError, match="outside its block table"):
        decode_attention(q, k, v, k_pool, v_pool, tables, torch.tensor([3, 32]), bf16=True)
    with pytest.raises(RuntimeError, match="outside the pool"):
        decode_attention(q, k, v, k_pool, v_pool, torch.tensor([[0, 1], [-1, 2]]), torch.tensor([3, 5]), bf16=True)


def test_only_for_bf16_weights_and_not_when_fp32_attention_is_asked(monkeypatch):
    assert bf16_supported(torch.bfloat16, CPU, 64)
    assert not bf16_supported(torch.float32, CPU, 64)
    assert not bf16_supported(torch.bfloat16, CPU, 80)
    monkeypatch.setenv("SIE_ATTENTION", "fp32")
    assert not bf16_supported(torch.bfloat16, CPU, 64)


@torch.inference_mode()
@pytest.mark.parametrize("kv", ["auto", "bfloat16", "int8"])
def test_mixed_decoder_logits_are_the_same_whole_chunked_cached_batched_or_decoded(monkeypatch, kv):
    """bf16 weights on the tiled kernel: the attention multiplies bf16 in prefill and decode alike, so every op of the
    forward is row-invariant and the bits cannot depend on the chunking, the prefix cache or the batch; with the KV
    cache in fp32 (`auto`), bf16 or int8 alike."""
    from engine.model.decoder import Decoder

    monkeypatch.setenv("SIE_LINEAR_KERNEL", "tiled")
    shape = dict(hidden_size=192, intermediate_size=256, num_attention_heads=3, num_key_value_heads=1,
                 max_position_embeddings=256)  # head dim 64, a GQA group of 3, as SmolLM2
    reference = tiny_llama(**shape)
    dec = Decoder(tiny_llama(**shape).to(torch.bfloat16), max_len=256)
    assert dec.bf16_attention and dec.dtype == torch.float32
    cache = dec.new_cache(3, 256, kv_dtype=kv)
    prompt = torch.randint(0, 256, (150,), generator=torch.Generator().manual_seed(1)).tolist()
    whole = dec.prefill(cache, 0, prompt, 0)
    ref = reference(torch.tensor([prompt])).logits[0, -1]
    assert (whole - ref).norm() / ref.norm() < 2e-2  # the fp32 model's logits, up to bf16 products
    assert_same_logits_chunked_cached_batched_or_decoded(dec, cache, prompt, whole)


@torch.inference_mode()
def test_a_bf16_kv_cache_costs_the_mixed_mode_no_bit(monkeypatch):
    """The products round K and V to bf16 as they read an fp32 pool, as a bf16 pool's write rounds them: half the
    KV bytes, the same logits, prefill and decode."""
    from engine.model.decoder import Decoder

    monkeypatch.setenv("SIE_LINEAR_KERNEL", "tiled")
    shape = dict(hidden_size=192, intermediate_size=256, num_attention_heads=3, num_key_value_heads=1,
                 max_position_embeddings=256)
    dec = Decoder(tiny_llama(**shape).to(torch.bfloat16), max_len=256)
    assert dec.bf16_attention
    fp32, bf16 = dec.new_cache(2, 256), dec.new_cache(2, 256, kv_dtype="bfloat16")
    assert bf16.k.dtype == torch.bfloat16 and 2 * bf16.bytes_per_token() == fp32.bytes_per_token()
    prompt = torch.randint(0, 256, (150,), generator=torch.Generator().manual_seed(1)).tolist()
    assert torch.equal(dec.prefill(bf16, 0, prompt, 0), dec.prefill(fp32, 0, prompt, 0))
    tokens, positions = torch.tensor([5, 9]), torch.tensor([150, 151])
    dec.prefill(bf16, 1, prompt + [3], 0)
    dec.prefill(fp32, 1, prompt + [3], 0)
    stepped = [dec.logits(dec.decode_hidden(c, tokens, positions, span=152)) for c in (bf16, fp32)]
    assert torch.equal(stepped[0], stepped[1])
