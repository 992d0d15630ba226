"""The fused forward refuses at load what it would otherwise ignore and compute wrong (tiny random models)."""

from __future__ import annotations

import pytest
import torch

SHAPE = dict(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=1, num_attention_heads=4,
             num_key_value_heads=2, max_position_embeddings=128)


def _llama(**kw):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    return LlamaForCausalLM(LlamaConfig(**SHAPE, architectures=["LlamaForCausalLM"], **kw)).eval()


def _mistral(**kw):
    from transformers import MistralConfig, MistralForCausalLM

    torch.manual_seed(0)
    return MistralForCausalLM(MistralConfig(**SHAPE, architectures=["MistralForCausalLM"], **kw)).eval()


@pytest.mark.parametrize(("model", "feature"), [
    (lambda: _llama(attention_bias=True), "attention_bias"),
    (lambda: _llama(mlp_bias=True), "mlp_bias"),
    (lambda: _mistral(sliding_window=16), "sliding_window"),
])
def test_a_feature_the_fused_forward_ignores_is_rejected_at_load_by_name(model, feature):
    from engine.model.decoder import Decoder

    with pytest.raises(ValueError, match=feature):
        Decoder(model(), max_len=64)


@torch.inference_mode()
def test_a_sliding_window_no_shorter_than_the_cache_is_full_attention_and_loads():
    from engine.model.decoder import Decoder
    from engine.runner.model_runner import ModelRunner

    model = _mistral(sliding_window=64)
    fwd = ModelRunner(Decoder(model, max_len=64), slots=1, max_len=64)
    prompt = [5, 17, 33, 2, 99, 140, 7]
    torch.testing.assert_close(fwd.prefill(0, prompt, 0), model(torch.tensor([prompt])).logits[0, -1],
                               rtol=1e-4, atol=1e-4)
