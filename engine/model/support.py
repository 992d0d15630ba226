"""What the engine cannot run exactly, found at load and named, so a model is refused instead of served wrong.

Three checks, cheapest first:
- the config alone (`config_refusal`): an encoder-decoder, or no causal-LM head transformers knows for it;
- the loaded model (`transformers_path_gaps`): state-space or other recurrent layers, attention that does not go
  through transformers' attention interface, bidirectional or chunked attention;
- short forwards (`check_against_own_forward`): the model's own forward over a sequence and over its prefix (a
  token must not see later ones), then ours on the engine's KV cache, once in one prefill and once continued from
  the cache. A head that post-processes
  logits in a way we do not know, or any layer that keeps state outside the attention interface, shows here.

Every refusal is an `UnsupportedModel` whose message starts with the feature, e.g. "state-space layers
(MambaMixer): ..."; Triton shows it as the model's unavailable reason.
"""

from __future__ import annotations

import re
from typing import Any

import torch

# module classes that hold a recurrent state between tokens, outside any attention call
_STATEFUL_CLASS = re.compile(
    r"Mixer$|SSM|RwkvSelfAttention|DeltaNet|LinearAttention|ShortConv|RecurrentBlock|Retention$")
# layer kinds that are attention (config.layer_types); anything else beside them makes the model a hybrid
_ATTENTION_LAYER_TYPES = {"full_attention", "sliding_attention", "chunked_attention", "attention"}


class UnsupportedModel(ValueError):
    """A model the engine cannot serve exactly; the message names the feature first."""


def config_refusal(config: Any) -> str | None:
    """Why a model cannot be served, from its config alone (None: nothing found there)."""
    arch = (getattr(config, "architectures", None) or [config.model_type])[0]
    if getattr(config, "is_encoder_decoder", False):
        return (f"encoder-decoder architecture ({arch}): the engine serves decoder-only models, whose prompt and "
                "output share one causal KV cache")
    quantized = getattr(config, "quantization_config", None)
    if quantized is not None:  # transformers would need that method's own kernels package, or de-quantize silently
        method = quantized.get("quant_method", "?") if isinstance(quantized, dict) else \
            getattr(quantized, "quant_method", "?")
        return (f"a pre-quantized checkpoint (quantization_config, quant_method {str(method)!r}): not served; serve "
                "its full-precision folder, with `quantization: int8` to quantize it at load (docs/quantization.md)")
    from transformers import AutoModelForCausalLM

    if type(config) not in AutoModelForCausalLM._model_mapping and getattr(config, "vision_config", None) is None:
        return (f"no causal language-model head for model_type {config.model_type!r} ({arch}): transformers has no "
                "AutoModelForCausalLM class for it")
    return None


def _stateful_layers(model: torch.nn.Module) -> list[str]:
    names = {type(m).__name__ for m in model.modules() if _STATEFUL_CLASS.search(type(m).__name__)}
    return sorted(names)


def _hybrid_layer_types(config: Any) -> list[str]:
    kinds = getattr(config, "layer_types", None) or getattr(config, "layers_block_type", None) or []
    return sorted({str(k) for k in kinds if isinstance(k, str)} - _ATTENTION_LAYER_TYPES)


def transformers_path_gaps(hf_model: torch.nn.Module) -> list[str]:
    """What the transformers path cannot run exactly, each named by its feature (empty: it can)."""
    config = hf_model.config
    problems = []
    stateful, hybrid = _stateful_layers(hf_model), _hybrid_layer_types(config)
    if stateful:
        problems.append(f"state-space or recurrent layers ({', '.join(stateful)}): they carry a state from token to "
                        "token that the engine's KV cache does not hold")
    elif hybrid:
        problems.append(f"hybrid layers of type {', '.join(hybrid)} beside attention (layer_types): they carry a "
                        "state that the engine's KV cache does not hold")
    if not getattr(hf_model, "_supports_attention_backend", False):
        problems.append(f"{type(hf_model).__name__} does not route attention through transformers' attention "
                        "interface")
    if getattr(config, "use_bidirectional_attention", False):
        problems.append("bidirectional attention (use_bidirectional_attention)")
    if getattr(config, "vision_config", None) is not None:
        problems.append("vision inputs (serve vision-language models on the fused path)")
    for name in ("attention_chunk_size", "chunk_size_feed_forward"):
        if getattr(config, name, None):
            problems.append(f"chunked attention ({name})")
    return problems


@torch.inference_mode()
def check_against_own_forward(decoder: Any) -> None:
    """Refuse a model whose logits on our cache differ from its own forward: once for a whole prefill (a head we
    do not know), once for a prefill continued from the cache (state kept outside attention)."""
    model = decoder.model
    ids = torch.arange(3, 11, device=decoder.device)
    with decoder.hf_attention():
        every = model(ids[None], use_cache=False).logits[0].float()
        prefix = model(ids[None, :5], use_cache=False).logits[0, -1].float()
    if not _close(prefix, every[4]):  # BERT as a "causal LM" without is_decoder, say
        raise UnsupportedModel(f"bidirectional attention in {type(model).__name__}: a token's logits change with "
                               "the tokens after it, so there is no causal generation to serve")
    expected = every[-1]
    whole = decoder.prefill(decoder.new_cache(1, len(ids)), 0, ids.tolist(), 0)
    if not _close(whole, expected):
        raise UnsupportedModel(f"an unknown logit post-processing in {type(model).__name__}'s head: the engine's "
                               "logits differ from the model's own forward")
    cache = decoder.new_cache(1, len(ids))
    decoder.prefill(cache, 0, ids[:5].tolist(), 0, sample=False)
    continued = decoder.prefill(cache, 0, ids[5:].tolist(), 5)
    if not _close(continued, expected):
        raise UnsupportedModel(f"state outside the attention interface in {type(model).__name__}: a prompt "
                               "continued from the engine's KV cache gives other logits than the whole prompt")


def _close(ours: torch.Tensor | None, expected: torch.Tensor) -> bool:
    return ours is not None and torch.allclose(ours, expected, rtol=1e-3,
                                               atol=1e-3 * max(1.0, expected.abs().max().item()))
