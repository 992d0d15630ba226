"""The shape of the keys and values a transformers model's attention really produces, for sizing its KV cache.

The config is not a safe source: GPT-2 and GPT-NeoX give every head its own keys and ignore a
`num_key_value_heads` that a converted or hand-edited config.json may still carry, and `head_dim` is likewise
optional. A cache sized from such a config cannot take the keys the model writes. So the shape is read from the
attention itself: one token's forward through a probe registered in transformers' attention interface, which
records each layer's key and value shapes and returns zeros of the attention output's shape.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from engine.model.support import UnsupportedModel

PROBE_NAME = "sie_kv_shape"


@dataclass(frozen=True)
class KVShape:
    """Per token and layer: `kv_heads` heads of keys and of values, each `head_dim` wide."""

    kv_heads: int
    head_dim: int


def _probe_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0,
                     sie_shapes: dict[int, tuple[tuple[int, ...], tuple[int, ...]]] | None = None, **kwargs):
    """transformers attention function: records (key shape, value shape) under the layer's index, returns zeros
    [1, N, H, value width] (the forward only has to reach every layer, not mean anything)."""
    if sie_shapes is None:
        raise RuntimeError(f"the {PROBE_NAME} attention runs only inside kv_shape")
    sie_shapes[module.layer_idx] = (tuple(key.shape), tuple(value.shape))
    b, heads, n = query.shape[:3]
    return query.new_zeros(b, n, heads, value.shape[-1]), None


@torch.inference_mode()
def kv_shape(hf_model: torch.nn.Module) -> KVShape:
    """The keys' and values' shape every attention layer of `hf_model` writes; refuses (UnsupportedModel) a model
    whose layers differ in it or whose values are not as wide as its keys, which one paged pool cannot hold."""
    from transformers import AttentionInterface

    AttentionInterface.register(PROBE_NAME, _probe_attention)
    base = hf_model.get_decoder()
    previous = hf_model.config._attn_implementation
    shapes: dict[int, tuple[tuple[int, ...], tuple[int, ...]]] = {}
    hf_model.set_attn_implementation(PROBE_NAME)
    try:
        ids = torch.zeros(1, 1, dtype=torch.long, device=next(hf_model.parameters()).device)
        base(input_ids=ids, use_cache=False, sie_shapes=shapes)
    finally:
        hf_model.set_attn_implementation(previous)
    if not shapes:
        raise UnsupportedModel(f"{type(hf_model).__name__} ran no attention through transformers' attention "
                               "interface")
    found = {(k[1], k[-1], v[1], v[-1]) for k, v in shapes.values()}
    if len(found) > 1:
        raise UnsupportedModel(f"attention layers of different key/value shapes (heads, width) in "
                               f"{type(hf_model).__name__}: {sorted(found)}; the KV cache holds one shape")
    kv_heads, head_dim, v_heads, v_dim = found.pop()
    if (v_heads, v_dim) != (kv_heads, head_dim):
        raise UnsupportedModel(f"values of another shape than keys in {type(hf_model).__name__} ({v_heads} heads "
                               f"of {v_dim}, keys {kv_heads} of {head_dim}); the KV cache holds one shape")
    return KVShape(kv_heads, head_dim)
