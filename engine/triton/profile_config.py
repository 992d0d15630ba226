"""The model's profile (config.pbtxt `parameters`, contract/profile.py) -> the engine's EngineConfig.

Kept apart from engine/triton/model.py, which needs Triton's Python backend, so that a test can build it.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path

from contract.profile import Profile, parse_profile
from engine.llm_engine import EngineConfig


def cache_path(name: str) -> str:
    """Model and adapter folders: absolute, or relative to SIE_MODEL_CACHE (default <repo>/.cache/models)."""
    if os.path.isabs(name):
        return name
    cache = os.environ.get("SIE_MODEL_CACHE") or str(Path(__file__).resolve().parents[2] / ".cache" / "models")
    return str(Path(cache) / name)


def engine_profile(parameters: Mapping[str, str]) -> Profile:
    """The engine's view of a profile; raises contract.profile.ProfileError naming a bad or unknown key."""
    return parse_profile(parameters, reader="engine")


def engine_config(profile: Profile, *, model_dir: str, triton_name: str, device: str, pod: str) -> EngineConfig:
    """EngineConfig from a validated profile. `model_dir` is the model's folder (its chat template file lives
    there); `pod` names this replica in the KV events topic (llm-d reads `kv@<pod>@<served model>`)."""
    assert profile.hf_model is not None  # required for the engine: parse_profile(reader="engine") refuses none
    chat_template = None
    if profile.chat_template:
        with open(os.path.join(model_dir, profile.chat_template), encoding="utf-8") as f:
            chat_template = f.read()
    return EngineConfig(
        model_path=cache_path(profile.hf_model),
        max_slots=profile.max_slots,
        max_len=profile.context_length,
        max_num_batched_tokens=profile.max_num_batched_tokens,
        max_num_partial_prefills=profile.max_num_partial_prefills,
        scheduling_policy=profile.scheduling_policy,
        check_scheduler_invariants=profile.debug_scheduler_invariants,
        burst_window_ms=profile.burst_window_ms,
        burst_quiet_ms=profile.burst_quiet_ms,
        max_queue=profile.max_queue,
        kv_budget_tokens=profile.kv_budget_tokens,
        kv_memory=profile.kv_memory,
        kv_cache_dtype=profile.kv_cache_dtype,
        quantization=profile.quantization,
        prefix_cache_tokens=profile.prefix_cache_tokens,
        dtype=profile.dtype,  # auto: bf16 on GPU, fp32 on CPU; "bfloat16" where the CPU has it
        threads=profile.threads,
        reasoning=profile.reasoning,
        grammar_budget_s=profile.grammar_compile_budget_s,
        cuda_graphs=profile.cuda_graphs,
        device=device,
        lora_paths={name: cache_path(path) for name, path in profile.lora_paths.items()},
        max_loras=profile.max_loras,  # run-time LoRA bound and rank limit (docs/lora.md)
        max_lora_rank=profile.max_lora_rank,
        model_impl=profile.model_impl,
        chat_template=chat_template,
        stop_tokens=list(profile.stop_tokens) or None,
        # KV events for KV-aware routers (docs/kv-memory.md)
        kv_events_endpoint=profile.kv_events_endpoint,
        kv_events_replay_endpoint=profile.kv_events_replay_endpoint,
        kv_events_topic=f"kv@{pod}@{profile.served_name or triton_name}",
    )
