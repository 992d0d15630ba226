"""Tiny random-weight models of many transformers architectures, built by the tests themselves (no download).

Each is `from_config` with 2 layers and tiny hidden sizes, seeded, saved as a Hugging Face folder with the SmolLM2
tokenizer (its 49,152-token vocabulary, its ChatML template) and a generation_config.json naming `<|im_end|>` as
the turn end. They exist to prove that the engine's transformers path gives HF `generate`'s greedy tokens for
every architecture feature these models exercise, and that `devstack.add_model` and the real stack serve them.
"""

from __future__ import annotations

import json
import os
import shutil
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
CACHE = Path(os.environ.get("SIE_MODEL_CACHE") or REPO / ".cache" / "models")
TOKENIZER_DIR = CACHE / "SmolLM2-135M-Instruct"
VOCAB = 49152
BOS, EOS = 1, 2  # SmolLM2's <|im_start|>, <|im_end|>


@dataclass(frozen=True)
class Arch:
    """One architecture: its config class (by name in transformers), the config fields, what it proves."""

    name: str
    config_class: str
    config: dict[str, Any]
    proves: str
    refused: str = ""  # the feature named by the refusal, for a model the engine must not serve
    extra: dict[str, Any] = field(default_factory=dict)


# the common tiny shape, in each config's own field names where they differ
_SHAPE = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, max_position_embeddings=256, bos_token_id=BOS, eos_token_id=EOS,
              pad_token_id=EOS)

ARCHITECTURES = [
    Arch("qwen2", "Qwen2Config", dict(_SHAPE), "QKV biases, GQA, untied head",
         extra={"tie_word_embeddings": False}),
    Arch("qwen3", "Qwen3Config", dict(_SHAPE, head_dim=32), "QK-norm, head_dim apart from hidden/heads"),
    Arch("mistral", "MistralConfig", dict(_SHAPE, sliding_window=32),
         "sliding window shorter than the cache (32 positions), GQA"),
    Arch("phi", "PhiConfig", dict(_SHAPE, num_key_value_heads=4, partial_rotary_factor=0.5),
         "partial rotary (half of each head), parallel residual, biases everywhere, LayerNorm"),
    Arch("gpt_neox", "GPTNeoXConfig", dict(_SHAPE, num_key_value_heads=None, rotary_pct=0.25,
                                           use_parallel_residual=True),
         "fused QKV projection, partial rotary (a quarter), parallel residual"),
    Arch("qwen2_moe", "Qwen2MoeConfig", dict(_SHAPE, moe_intermediate_size=32, shared_expert_intermediate_size=64,
                                             num_experts=4, num_experts_per_tok=2, decoder_sparse_step=1),
         "mixture of experts (4 experts, top 2) with a gated shared expert"),
    Arch("mixtral", "MixtralConfig", dict(_SHAPE, num_local_experts=4, num_experts_per_tok=2),
         "mixture of experts (4 experts, top 2), sparse routing only"),
    Arch("gemma2", "Gemma2Config", dict(_SHAPE, head_dim=16, sliding_window=16, query_pre_attn_scalar=24,
                                        attn_logit_softcapping=50.0, final_logit_softcapping=30.0),
         "attention and final-logit soft-capping, alternating sliding window, query_pre_attn_scalar"),
    Arch("gpt2", "GPT2Config", dict(vocab_size=VOCAB, n_embd=64, n_layer=2, n_head=4, n_positions=256,
                                    bos_token_id=BOS, eos_token_id=EOS),
         "learned position embeddings, Conv1D fused QKV, LayerNorm, GELU"),
    Arch("opt", "OPTConfig", dict(vocab_size=VOCAB, hidden_size=64, ffn_dim=128, num_hidden_layers=2,
                                  num_attention_heads=4, max_position_embeddings=256, word_embed_proj_dim=32,
                                  bos_token_id=BOS, eos_token_id=EOS, pad_token_id=EOS),
         "learned position embeddings (offset 2), embedding projections in and out"),
    Arch("cohere", "CohereConfig", dict(_SHAPE, logit_scale=0.5, use_qk_norm=True),
         "logit scaling in the head (logit_scale), parallel residual, QK-norm"),
    Arch("granite", "GraniteConfig", dict(_SHAPE, logits_scaling=4.0, embedding_multiplier=6.0,
                                          residual_multiplier=0.5, attention_multiplier=0.2),
         "logit, embedding, residual and attention multipliers"),
    Arch("starcoder2", "Starcoder2Config", dict(_SHAPE, use_bias=True), "biases, LayerNorm, GELU MLP"),
    Arch("mamba", "MambaConfig", dict(vocab_size=VOCAB, hidden_size=64, state_size=8, num_hidden_layers=2,
                                      bos_token_id=BOS, eos_token_id=EOS, pad_token_id=EOS),
         "refused at load", refused="state-space or recurrent layers"),
    Arch("lfm2", "Lfm2Config", dict(_SHAPE, layer_types=["conv", "full_attention"]),
         "refused at load", refused="recurrent layers \\(Lfm2ShortConv\\)"),
    Arch("stablelm", "StableLmConfig", dict(_SHAPE), "refused at load",
         refused="does not route attention through transformers' attention interface"),
    Arch("t5", "T5Config", dict(vocab_size=VOCAB, d_model=64, d_kv=16, d_ff=128, num_layers=2, num_heads=4,
                                decoder_start_token_id=EOS, eos_token_id=EOS, pad_token_id=EOS),
         "refused at load", refused="encoder-decoder"),
]
SERVED = [a for a in ARCHITECTURES if not a.refused]
REFUSED = [a for a in ARCHITECTURES if a.refused]


def build_model(arch: Arch):
    """The random-weight model (seeded, eval mode, fp32)."""
    import torch
    import transformers

    torch.manual_seed(0)
    config = getattr(transformers, arch.config_class)(**arch.config, **arch.extra)
    if config.is_encoder_decoder:
        return transformers.AutoModelForSeq2SeqLM.from_config(config).eval()
    model = transformers.AutoModelForCausalLM.from_config(config).eval()
    with torch.no_grad():  # larger weights than the default init: logits far apart, greedy ties impossible
        for param in model.parameters():
            if param.dim() > 1:
                param.mul_(4.0)
    return model


def ensure_tiny_model(arch: Arch, root: Path) -> Path:
    """`root/<name>`: the model, the SmolLM2 tokenizer and a generation config; built once (a `.complete` marker)."""
    out = root / arch.name
    if (out / ".complete").exists():
        return out
    from transformers import AutoTokenizer

    shutil.rmtree(out, ignore_errors=True)
    model = build_model(arch)
    model.save_pretrained(out)
    AutoTokenizer.from_pretrained(TOKENIZER_DIR).save_pretrained(out)
    config = json.loads((out / "config.json").read_text())
    config["_name_or_path"] = f"sie-test/tiny-{arch.name}"
    (out / "config.json").write_text(json.dumps(config, indent=2))
    (out / "generation_config.json").write_text(json.dumps({"bos_token_id": BOS, "eos_token_id": [EOS]}))
    (out / ".complete").touch()
    return out


def trimmed(ids: list[int]) -> list[int]:
    """Token ids up to and including the first EOS (the turn end), as a served sequence ends."""
    return ids[: ids.index(EOS) + 1] if EOS in ids else ids


def hf_greedy(path: Path, prompts: list[str], new_tokens: int) -> list[list[int]]:
    """HF `generate`'s greedy continuation of each prompt, in fp32, up to its first EOS."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(path)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    out = []
    for prompt in prompts:
        ids = tokenizer(prompt, return_tensors="pt").input_ids
        generated = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new_tokens,
                                   do_sample=False)
        out.append(trimmed(generated[0, ids.shape[1]:].tolist()))
    return out
