"""A served model's profile (its config.pbtxt `parameters`), derived from the Hugging Face folder's own files.

Torch-free: config.json, generation_config.json, tokenizer_config.json / chat_template.jinja, tokenizer.json and
the weight files' sizes are read as they are. What the folder does not say gets a default sized from the model
(its weights and its K/V bytes a token) and the memory there is for K/V.
"""

from __future__ import annotations

import json
import os
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

# the KV positions of one request we plan for when sizing slots (prompt + output of a typical chat turn)
TYPICAL_REQUEST_TOKENS = 2048
MAX_SLOTS = {"cpu": 32, "gpu": 128}
# on CPU the default context stays modest: a longer one is allowed, but every slot could then reserve it
CPU_CONTEXT_CAP = 8192
PREFIX_CACHE_CAP = 16384
# turn-closing markers a chat template writes after each message; a stop token where the template uses one
TURN_END_MARKERS = ("<|im_end|>", "<end_of_turn>", "<|eot_id|>", "<|end|>", "<|end_of_turn|>", "<|eom_id|>",
                    "<turn|>", "<|endofturn|>")
_CONTEXT_FIELDS = ("max_position_embeddings", "n_positions", "max_sequence_length", "seq_length", "n_ctx")


@dataclass
class Profile:
    served_name: str
    parameters: dict[str, str]
    notes: list[str] = field(default_factory=list)  # what was derived and from where, for the user to read


def _read_json(path: Path) -> dict[str, Any]:
    return json.loads(path.read_text(encoding="utf-8")) if path.exists() else {}


def served_name(folder: Path, config: dict[str, Any], override: str | None = None) -> str:
    """SERVED_NAME / --name, else the config's `_name_or_path` (a hub id, not a local path), else the folder's name."""
    if override:
        return override
    named = config.get("_name_or_path")
    if isinstance(named, str) and named and not os.path.isabs(named) and not named.startswith("."):
        return named
    return folder.resolve().name


def text_config(config: dict[str, Any]) -> dict[str, Any]:
    """The language model's config: `text_config` for a vision-language model, else the config itself."""
    return {**config, **config["text_config"]} if isinstance(config.get("text_config"), dict) else config


def context_length(config: dict[str, Any]) -> int | None:
    text = text_config(config)
    found = [text[k] for k in _CONTEXT_FIELDS if isinstance(text.get(k), int) and text[k] > 0]
    return found[0] if found else None


def kv_bytes_per_token(config: dict[str, Any], dtype_bytes: int, scale_bytes: int = 0) -> int:
    """K and V of every layer for one position (the engine keeps every layer's positions, windows included);
    `scale_bytes` beside each KV head's row of values (int8's scale)."""
    text = text_config(config)
    layers = text.get("num_hidden_layers") or text.get("n_layer") or text.get("num_layers") or 1
    heads = text.get("num_attention_heads") or text.get("n_head") or 1
    kv_heads = text.get("num_key_value_heads") or heads
    hidden = text.get("hidden_size") or text.get("n_embd") or text.get("d_model") or 0
    head_dim = text.get("head_dim") or (hidden // heads if heads else 0)
    return max(1, 2 * layers * kv_heads * (head_dim * dtype_bytes + scale_bytes))


def weight_bytes(folder: Path) -> int:
    return sum(p.stat().st_size for p in folder.iterdir() if p.suffix in (".safetensors", ".bin", ".pt"))


def chat_template(folder: Path) -> str | None:
    """The template transformers would load: chat_template.jinja, else tokenizer_config.json's `chat_template`."""
    jinja = folder / "chat_template.jinja"
    if jinja.exists():
        return jinja.read_text(encoding="utf-8")
    value = _read_json(folder / "tokenizer_config.json").get("chat_template")
    if isinstance(value, list):  # named templates: the default one
        value = next((t.get("template") for t in value if t.get("name") == "default"), None)
    return value if isinstance(value, str) and value.strip() else None


def _token_strings(folder: Path) -> dict[int, str]:
    """id -> string for the tokenizer's added (special) tokens, from tokenizer.json / tokenizer_config.json."""
    tokens = {t["id"]: t["content"] for t in _read_json(folder / "tokenizer.json").get("added_tokens", [])}
    decoder = _read_json(folder / "tokenizer_config.json").get("added_tokens_decoder", {})
    tokens.update({int(k): v["content"] for k, v in decoder.items() if isinstance(v, dict) and "content" in v})
    return tokens


def stop_tokens(folder: Path, template: str | None) -> list[str]:
    """Turn-end tokens: generation_config.json's `eos_token_id` (as token strings), and the turn-closing marker the
    chat template writes when the tokenizer has it as a token (a GGUF's generation config often names only EOS)."""
    ids = _read_json(folder / "generation_config.json").get("eos_token_id")
    ids = [ids] if isinstance(ids, int) else list(ids or [])
    strings = _token_strings(folder)
    found = [strings[i] for i in ids if i in strings]
    for marker in TURN_END_MARKERS:
        if template and marker in template and marker in strings.values() and marker not in found:
            found.append(marker)
    return found


def default_sampling(folder: Path) -> dict[str, float | int]:
    """The model card's sampling, as generation_config.json gives it (only where it samples at all)."""
    generation = _read_json(folder / "generation_config.json")
    if not generation.get("do_sample"):
        return {}
    return {k: generation[k] for k in ("temperature", "top_p", "top_k")
            if isinstance(generation.get(k), (int, float)) and not isinstance(generation.get(k), bool)}


def available_kv_memory(kind: str, weights: int) -> int:
    """Bytes for K/V by default: a quarter of the host's available memory on CPU; on GPU, 80 % of the device's
    memory less the weights (nvidia-smi's total when it is there, else 16 GiB assumed)."""
    if kind == "gpu":
        total = _gpu_total_bytes() or 16 << 30
        return max(256 << 20, int(total * 0.8) - weights)
    meminfo = Path("/proc/meminfo")
    available = 8 << 30
    if meminfo.exists():
        match = re.search(r"MemAvailable:\s+(\d+) kB", meminfo.read_text())
        available = int(match.group(1)) * 1024 if match else available
    return max(256 << 20, available // 4)


def _gpu_total_bytes() -> int | None:
    import shutil
    import subprocess

    if not shutil.which("nvidia-smi"):
        return None
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=memory.total", "--format=csv,noheader,nounits"],
                             capture_output=True, text=True, timeout=10, check=True).stdout.split()
        return int(out[0]) << 20 if out else None
    except (OSError, subprocess.SubprocessError, ValueError):
        return None


def derive(folder: Path, *, name: str | None = None, kind: str = "cpu", model_path: str | None = None,
           kv_memory_bytes: int | None = None, kv_cache_dtype: str = "auto", quantization: str = "none") -> Profile:
    """The profile of the model in `folder`, served on `kind` ("cpu": fp32, "gpu": bf16), its K/V stored as
    `kv_cache_dtype` says (`bfloat16`: 2 bytes a value on either kind, `int8`: 1 and a 4-byte scale a row of
    head_dim values, so the budget holds more tokens), its linears' weights as `quantization` says (`int8`)."""
    folder = folder.resolve()
    config = _read_json(folder / "config.json")
    if not config:
        raise ValueError(f"{folder} has no config.json: not a Hugging Face model folder")
    served = served_name(folder, config, name)
    notes = []
    dtype_bytes = 1 if kv_cache_dtype == "int8" else 4 if kind == "cpu" and kv_cache_dtype == "auto" else 2
    per_token = kv_bytes_per_token(config, dtype_bytes, 4 if kv_cache_dtype == "int8" else 0)
    kv_memory = kv_memory_bytes or available_kv_memory(kind, weight_bytes(folder))
    memory_tokens = max(256, kv_memory // per_token // 16 * 16)
    declared = context_length(config)
    context = declared or 2048
    if kind == "cpu":
        context = min(context, CPU_CONTEXT_CAP)
    context = min(context, memory_tokens)  # one request at full length must fit the K/V budget
    slots = max(4, min(MAX_SLOTS[kind], memory_tokens // min(context, TYPICAL_REQUEST_TOKENS)))
    kv_tokens = min(memory_tokens, slots * context)  # admission never reserves more than every slot at full length
    # the prefix cache's pool is committed at load: a quarter of the budget, at most PREFIX_CACHE_CAP positions
    prefix = min(PREFIX_CACHE_CAP, kv_tokens // 4) // 16 * 16
    notes.append(f"context_length {context} (config: {declared or 'not given, 2048 assumed'}); {slots} slots; K/V "
                 f"{per_token} B a token, budget {kv_tokens} tokens ({kv_tokens * per_token / 2**30:.2f} GiB of "
                 f"{kv_memory / 2**30:.1f} GiB available)")
    template = chat_template(folder)
    is_vision = isinstance(config.get("vision_config"), dict)
    stops = stop_tokens(folder, template)
    reasoning = bool(template and "<think>" in template)
    notes.append("chat template: " + ("the tokenizer's" if template else
                                      "none (chat answers 400 naming `messages`; completions work)"))
    notes.append(f"stop tokens: {', '.join(stops) or 'the tokenizer EOS only'}")
    if template and "enable_thinking" in template:
        notes.append('reasoning switch: requests set chat_template_kwargs {"enable_thinking": false} to turn it off')
    parameters = {
        "served_name": served,
        "hf_model": model_path or str(folder),
        # auto: the fused forward where it is exact for the architecture, else transformers' modeling code
        "model_impl": "auto",
        "context_length": str(context),
        "max_output_tokens": str(context),
        "max_slots": str(slots),
        "max_queue": str(slots * 4),
        "kv_budget_tokens": str(kv_tokens),
        "prefix_cache_tokens": str(prefix),
        "max_num_batched_tokens": "1024",
        "burst_window_ms": "20",
        "grammar_kinds": "" if is_vision else "json_schema,regex,ebnf",
        "image_input": "true" if is_vision else "false",
        "reasoning": "true" if reasoning else "false",
        "stop_tokens": ",".join(stops),
        "lora_paths": "{}",
        "default_sampling": json.dumps(default_sampling(folder)),
    }
    if kv_cache_dtype != "auto":
        parameters["kv_cache_dtype"] = kv_cache_dtype
    if quantization != "none":
        parameters["quantization"] = quantization
    return Profile(served, parameters, notes)
