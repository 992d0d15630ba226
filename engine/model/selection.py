"""Which forward serves a model: the fused fast path where it is exact, else transformers' own modeling code.

`model_impl` in the profile: `auto` (default) picks the fused forward for the architectures it knows and whose
declared features it computes (engine.model.loading.unsupported_features), and the transformers path
otherwise; `fused` and `transformers` force one. A model the chosen path cannot run exactly is refused at load
with the feature named, never served wrong.
"""

from __future__ import annotations

import logging

import torch

from engine.model.decoder import SUPPORTED_ARCHITECTURES, Decoder
from engine.model.loading import language_model, unsupported_features
from engine.model.transformers_decoder import TransformersDecoder

log = logging.getLogger(__name__)

MODEL_IMPLS = ("auto", "fused", "transformers")
AnyDecoder = Decoder | TransformersDecoder  # one interface: new_cache, prefill, prefill_batch, decode_hidden, logits


def fused_path_gaps(hf_model: torch.nn.Module, max_len: int) -> list[str]:
    """What the fused forward would get wrong for this model, by name (empty: it is exact)."""
    config, inner, arch = language_model(hf_model)
    if arch not in SUPPORTED_ARCHITECTURES:
        return [f"architecture {arch}"]
    return unsupported_features(config, inner, max_len)


def build_decoder(hf_model: torch.nn.Module, impl: str, max_len: int, quantization: str = "none") -> AnyDecoder:
    """`quantization` other than `none` runs on the fused forward only (our int8 kernels); a model that needs the
    transformers path is refused with the reason."""
    if impl not in MODEL_IMPLS:
        raise ValueError(f"model_impl must be one of {', '.join(MODEL_IMPLS)}, not {impl!r}")
    if impl != "transformers":
        gaps = fused_path_gaps(hf_model, max_len)
        if not gaps:
            return Decoder(hf_model, max_len, quantization)
        if impl == "fused":
            raise ValueError("model_impl fused cannot run this model exactly: " + "; ".join(gaps))
        log.info("serving with transformers' modeling code; the fused forward lacks: %s", "; ".join(gaps))
    if quantization != "none":
        raise ValueError(f"quantization {quantization} runs on the fused forward only, and this model is served with "
                         "transformers' modeling code (model_impl transformers, or the fused forward lacks a feature "
                         "it needs); serve it with quantization: none")
    return TransformersDecoder(hf_model, max_len)
