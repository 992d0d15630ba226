"""Tiny random models for unit tests of the forward (seeded, so every test builds the same weights)."""

from __future__ import annotations

import torch


def tiny_llama(**shape):
    """A 2-layer random Llama; `shape` overrides its config (hidden_size, heads, ...)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = dict(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, max_position_embeddings=128)
    config.update(shape)
    return LlamaForCausalLM(LlamaConfig(**config, architectures=["LlamaForCausalLM"])).eval()
