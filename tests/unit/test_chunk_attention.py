"""A prompt chunk that continues a cached prefix (engine/model/chunk_attention.py): the prefix without a mask and
the chunk causal, merged by log-sum-exp, equal SDPA with the causal-from-`start` mask; and the fused decoder's
chunked prefill, which uses it on CPU, still equals HF."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from engine.model.chunk_attention import continued_chunk_attention


def _masked(q, k, v, start):
    n, end = q.shape[2], k.shape[2]
    mask = torch.ones(n, end, dtype=torch.bool).tril(diagonal=start)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True)


@pytest.mark.parametrize(("n", "start"), [(1, 1), (1, 300), (7, 3), (64, 64), (200, 512), (512, 100)])
@pytest.mark.parametrize(("heads", "kv_heads"), [(9, 3), (4, 4)])
def test_equals_sdpa_with_the_causal_from_start_mask(n, start, heads, kv_heads):
    torch.manual_seed(n + start)
    q = torch.randn(1, heads, n, 64)
    k, v = torch.randn(1, kv_heads, start + n, 64), torch.randn(1, kv_heads, start + n, 64)
    torch.testing.assert_close(continued_chunk_attention(q, k, v, start), _masked(q, k, v, start),
                               rtol=1e-5, atol=1e-5)


def test_a_non_contiguous_query_as_the_decoder_passes_it():
    """The decoder hands q as [n, H, D] transposed, and K/V as slices of a cache longer than `end`."""
    torch.manual_seed(0)
    n, start = 40, 90
    q = torch.randn(n, 6, 32).transpose(0, 1).unsqueeze(0)
    cache_k, cache_v = torch.randn(1, 2, 256, 32), torch.randn(1, 2, 256, 32)
    k, v = cache_k[:, :, : start + n], cache_v[:, :, : start + n]
    torch.testing.assert_close(continued_chunk_attention(q, k, v, start), _masked(q.contiguous(), k, v, start),
                               rtol=1e-5, atol=1e-5)


def test_bf16_stays_close_to_the_fp32_result():
    torch.manual_seed(1)
    q, k, v = torch.randn(1, 9, 48, 64), torch.randn(1, 3, 160, 64), torch.randn(1, 3, 160, 64)
    got = continued_chunk_attention(q.bfloat16(), k.bfloat16(), v.bfloat16(), 112)
    assert got.dtype == torch.bfloat16
    torch.testing.assert_close(got.float(), _masked(q, k, v, 112), rtol=0.03, atol=0.03)


@torch.inference_mode()
def test_the_decoders_chunked_prefill_equals_hf_at_the_end_of_every_chunk():
    from transformers import LlamaConfig, LlamaForCausalLM

    from engine.model.decoder import Decoder
    from engine.runner.model_runner import ModelRunner

    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(vocab_size=256, hidden_size=96, intermediate_size=128, num_hidden_layers=2,
                                         num_attention_heads=6, num_key_value_heads=2, max_position_embeddings=256,
                                         architectures=["LlamaForCausalLM"])).eval()
    fwd = ModelRunner(Decoder(model, max_len=256), slots=1, max_len=256)
    prompt = torch.randint(0, 256, (150,)).tolist()
    reference = model(torch.tensor([prompt])).logits[0]
    start = 0
    for size in (40, 1, 64, 45):  # chunks continuing 40, 41 and 105 cached positions
        logits = fwd.prefill(0, prompt[start : start + size], start)
        start += size
        torch.testing.assert_close(logits, reference[start - 1], rtol=1e-4, atol=1e-4)
