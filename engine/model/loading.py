"""Loading every served model (text or vision-language) and finding its language model.

A vision model is recognised by `vision_config` in its config and comes with its processor; for
Decoder both kinds reduce to (text config, decoder module, causal-LM architecture).
"""

from __future__ import annotations

from typing import Any

import torch

from engine.model.support import UnsupportedModel, config_refusal

# text model_type -> the causal-LM architecture Decoder knows it as
TEXT_ARCHITECTURES = {
    "llama": "LlamaForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
    "mistral": "MistralForCausalLM",
}


def is_vision_config(config: Any) -> bool:
    return getattr(config, "vision_config", None) is not None


def load_model(path: str, dtype: torch.dtype, device: str) -> tuple[torch.nn.Module, Any, Any]:
    """(model in eval mode on `device`, tokenizer, processor or None for a text-only model).

    Weights are materialised straight on `device` (no full host copy first on a GPU).
    """
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    placement = {"device_map": device} if device != "cpu" else {}
    config = AutoConfig.from_pretrained(path)
    refusal = config_refusal(config)
    if refusal:
        raise UnsupportedModel(refusal)
    if not is_vision_config(config):
        tokenizer = AutoTokenizer.from_pretrained(path)
        # sdpa where the model has it, else its eager attention (Gemma 2's soft-capped scores): the reference our
        # own attention function is checked against at load (engine.model.support)
        model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype, **placement)
        return model.to(device).eval(), tokenizer, None
    from transformers import AutoModelForImageTextToText, AutoProcessor

    processor = AutoProcessor.from_pretrained(path)
    model = AutoModelForImageTextToText.from_pretrained(path, dtype=dtype, attn_implementation="sdpa", **placement)
    return model.to(device).eval(), processor.tokenizer, processor


def language_model(hf_model: torch.nn.Module) -> tuple[Any, torch.nn.Module, str]:
    """(text config, decoder module with embed_tokens/layers/norm, causal-LM architecture name)."""
    config = hf_model.config
    if not is_vision_config(config):  # `model` for Llama-like ones, `transformer` for GPT-2, `gpt_neox`, ...
        return config, hf_model.get_decoder(), (config.architectures or ["?"])[0]
    text_config = config.get_text_config()
    inner = getattr(hf_model.model, "language_model", None)
    if inner is None or not hasattr(inner, "layers"):
        raise ValueError(f"{type(hf_model).__name__}: no language model with decoder layers found")
    return text_config, inner, TEXT_ARCHITECTURES.get(text_config.model_type, text_config.model_type)


def release_linear_weights(hf_model: torch.nn.Module) -> None:
    """Let go of the decoder layers' linear weights (and an untied LM head's): each becomes a stride-0 view of one
    zero, with its shape and dtype and no memory. Once the fused forward holds its own quantized copies the model's
    are dead weight, the size of the whole model; the shapes stay for LoRA's checks and peft's wrapping."""
    _, inner, _ = language_model(hf_model)
    linears = [m for m in inner.layers.modules() if isinstance(m, torch.nn.Linear)]
    head = hf_model.get_output_embeddings()
    if isinstance(head, torch.nn.Linear) and head.weight is not inner.embed_tokens.weight:
        linears.append(head)
    for linear in linears:
        weight = linear.weight
        linear.weight = torch.nn.Parameter(torch.zeros((), dtype=weight.dtype, device=weight.device)
                                           .expand(weight.shape), requires_grad=False)


def unsupported_features(config: Any, inner: torch.nn.Module, max_len: int) -> list[str]:
    """What the model uses that Decoder would silently compute wrong, each named as its config does.

    A sliding window no shorter than the cache never masks anything, so it is full attention and allowed.
    """
    found = []
    layer = inner.layers[0]
    if getattr(layer.self_attn.o_proj, "bias", None) is not None:
        found.append("attention_bias (an o_proj bias)")
    mlp = (getattr(layer.mlp, name) for name in ("gate_proj", "up_proj", "down_proj"))
    if any(getattr(linear, "bias", None) is not None for linear in mlp):
        found.append("mlp_bias")
    window = getattr(config, "sliding_window", None)
    layer_types = getattr(config, "layer_types", None)
    if layer_types is not None and "sliding_attention" not in layer_types:
        window = None  # e.g. Qwen2 with use_sliding_window false: the field is there but unused
    if window is not None and window < max_len:
        found.append(f"sliding_window ({window} positions, shorter than the {max_len}-position cache)")
    return found
