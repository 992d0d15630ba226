"""engine/model/kernels/attention_bf16.cpp: causal attention with bf16 products (the bf16 profile's mixed mode), on
AMX tiles or vdpbf16ps, whichever this CPU has, is as close to fp32 SDPA as bf16 products allow, and keeps the fp32
kernel's guarantees bit for bit: a query's output does not depend on its chunk, the cached prefix or the batch, and
a decode step gives the bits a prefill gives; through the decoder, a prompt's logits are the same whole, chunked,
cached, batched or decoded."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from engine.model import cpu_kernels
from engine.model.attention import bf16_supported, chunk_attention, decode_attention
from tests.unit.decoder_checks import assert_same_logits_chunked_cached_batched_or_decoded
from tests.unit.tiny_models import tiny_llama

pytestmark = pytest.mark.skipif(not (cpu_kernels.available() and torch.ops.sie_kernels.has_avx512_bf16()),
                                reason="the bf16 attention kernel runs where the CPU has AVX512_BF16")

CPU = torch.device("cpu")


def _kernel(q, k, v, start):
    return chunk_attention(q, k, v, start, native=True, bf16=True)


def _reference(q, k, v, start):
    """fp64 attention over the inputs rounded as the kernel rounds them (q scaled first)."""
    def rounded(t):
        return t.to(torch.bfloat16).double()

    d, n, end = q.shape[-1], q.shape[0], start + q.shape[0]
    mask = torch.ones(n, end, dtype=torch.bool).tril(diagonal=start)
    out = F.scaled_dot_product_attention(rounded(q * d**-0.5).transpose(0, 1)[None], rounded(k[None, :, :end]),
                                         rounded(v[None, :, :end]), attn_mask=mask, scale=1.0, enable_gqa=True)
    return out[0].transpose(0, 1).float()


@pytest.mark.parametrize(("n", "start", "heads", "kv_heads", "head_dim"), [
    (1, 0, 9, 3, 64), (37, 0, 9, 3, 64), (200, 0, 9, 3, 64), (50, 93, 9, 3, 64),  # SmolLM2's shape
    (1, 300, 9, 3, 64), (70, 20, 4, 4, 128), (33, 5, 14, 2, 64), (40, 3, 8, 1, 256),  # no GQA; a group of 7; D 256
])
def test_close_to_attention_over_the_bf16_rounded_inputs(n, start, heads, kv_heads, head_dim):
    """What is left is P's rounding to bf16 (8 bits): well under 1 % of the output."""
    torch.manual_seed(0)
    q = torch.randn(n, heads, head_dim)
    k, v = torch.randn(kv_heads, start + n + 7, head_dim), torch.randn(kv_heads, start + n + 7, head_dim)
    got, ref = _kernel(q, k, v, start), _reference(q, k, v, start)
    assert (got - ref).norm() / ref.norm() < 4e-3
    torch.testing.assert_close(got, ref, rtol=2e-2, atol=2e-2)


def test_a_query_gives_the_same_bits_in_any_chunk_after_any_prefix():
    torch.manual_seed(0)
    n = 181
    q, k, v = torch.randn(n, 9, 64), torch.randn(3, n, 64), torch.randn(3, n, 64)
    whole = _kernel(q, k, v, 0)
    for start, end in [(0, 1), (0, 50), (50, 51), (50, 181), (17, 100), (31, 33), (180, 181)]:
        assert torch.equal(_kernel(q[start:end], k, v, start), whole[start:end]), (start, end)


def test_a_decode_step_writes_its_key_and_value_and_gives_the_prefills_bits():
    torch.manual_seed(0)
    positions = torch.tensor([0, 31, 32, 40, 63, 150, 199])  # either side of 32-key blocks, the cache's end
    b = len(positions)
    q, k, v = torch.randn(b, 9, 64), torch.randn(b, 3, 64), torch.randn(b, 3, 64)
    k_cache, v_cache = torch.randn(b + 1, 3, 200, 64), torch.randn(b + 1, 3, 200, 64)
    for row, p in enumerate(positions.tolist()):  # what a slot holds past its position never reaches the output
        k_cache[row, :, p + 1 :], v_cache[row, :, p + 1 :] = float("nan"), float("nan")
    untouched = k_cache[b].clone()
    out = decode_attention(q, k, v, k_cache, v_cache, positions, bf16=True)
    assert torch.equal(k_cache[b], untouched) and not out.isnan().any()
    for row, p in enumerate(positions.tolist()):
        assert torch.equal(k_cache[row, :, p], k[row]) and torch.equal(v_cache[row, :, p], v[row])
        queries = torch.randn(p + 1, 9, 64)
        queries[p] = q[row]  # the prefill of the whole slot, this row's query last
        assert torch.equal(_kernel(queries, k_cache[row], v_cache[row], 0)[p], out[row]), row
        assert torch.equal(_kernel(q[row : row + 1], k_cache[row], v_cache[row], p)[0], out[row]), row
        torch.testing.assert_close(out[row], _reference(q[row : row + 1], k_cache[row], v_cache[row], p)[0],
                                   rtol=2e-2, atol=2e-2)


def test_bad_shapes_are_refused():
    with pytest.raises(RuntimeError, match="multiple of 32"):
        _kernel(torch.randn(4, 4, 48), torch.randn(2, 4, 48), torch.randn(2, 4, 48), 0)
    with pytest.raises(RuntimeError, match="keys 0..start"):
        _kernel(torch.randn(4, 3, 64), torch.randn(1, 5, 64), torch.randn(1, 5, 64), 2)
    q, k, v = torch.randn(2, 9, 64), torch.randn(2, 3, 64), torch.randn(2, 3, 64)
    caches = torch.randn(2, 3, 16, 64), torch.randn(2, 3, 16, 64)
    with pytest.raises(RuntimeError, match="outside the cache"):
        decode_attention(q, k, v, *caches, torch.tensor([3, 16]), bf16=True)


def test_only_for_bf16_weights_and_not_when_fp32_attention_is_asked(monkeypatch):
    assert bf16_supported(torch.bfloat16, CPU, 64)
    assert not bf16_supported(torch.float32, CPU, 64)
    assert not bf16_supported(torch.bfloat16, CPU, 80)
    monkeypatch.setenv("SIE_ATTENTION", "fp32")
    assert not bf16_supported(torch.bfloat16, CPU, 64)


@torch.inference_mode()
def test_mixed_decoder_logits_are_the_same_whole_chunked_cached_batched_or_decoded(monkeypatch):
    """bf16 weights on the tiled kernel: the attention multiplies bf16 in prefill and decode alike, so every op of the
    forward is row-invariant and the bits cannot depend on the chunking, the prefix cache or the batch."""
    from engine.model.decoder import Decoder

    monkeypatch.setenv("SIE_LINEAR_KERNEL", "tiled")
    shape = dict(hidden_size=192, intermediate_size=256, num_attention_heads=3, num_key_value_heads=1,
                 max_position_embeddings=256)  # head dim 64, a GQA group of 3, as SmolLM2
    reference = tiny_llama(**shape)
    dec = Decoder(tiny_llama(**shape).to(torch.bfloat16), max_len=256)
    assert dec.bf16_attention and dec.dtype == torch.float32
    cache = dec.new_cache(3, 256)
    prompt = torch.randint(0, 256, (150,), generator=torch.Generator().manual_seed(1)).tolist()
    whole = dec.prefill(cache, 0, prompt, 0)
    ref = reference(torch.tensor([prompt])).logits[0, -1]
    assert (whole - ref).norm() / ref.norm() < 2e-2  # the fp32 model's logits, up to bf16 products
    assert_same_logits_chunked_cached_batched_or_decoded(dec, cache, prompt, whole)
