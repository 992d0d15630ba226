"""Shared fixtures for the engine tests: the real SmolLM2 model, loaded once per test session."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
MODEL_DIR = Path(os.environ.get("SIE_MODEL_CACHE") or REPO / ".cache" / "models") / "SmolLM2-135M-Instruct"
ENGINE_SLOTS = 4
ENGINE_MAX_LEN = 256


def _require_model() -> None:
    if not (MODEL_DIR / "config.json").exists():
        pytest.skip(f"model not prepared at {MODEL_DIR} (run `make model`)")


@pytest.fixture(scope="session")
def tokenizer():
    _require_model()
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(MODEL_DIR)


@pytest.fixture(scope="session")
def real_engine():
    """One started LLMEngine (small: 4 slots, 256 positions) for the whole session."""
    _require_model()
    import torch

    from engine.llm_engine import EngineConfig, LLMEngine

    torch.manual_seed(0)
    eng = LLMEngine(EngineConfig(str(MODEL_DIR), max_slots=ENGINE_SLOTS, max_len=ENGINE_MAX_LEN, threads=2,
                                 check_scheduler_invariants=True))
    eng.start()
    yield eng
    eng.stop()


@pytest.fixture
def make_scheduler(real_engine):
    """A synchronous EngineCore over the session model's weights with its own KV cache (stepped by the test)."""
    from engine.core.engine_core import EngineCore
    from engine.runner.model_runner import ModelRunner

    def make(slots: int = 8, max_len: int = ENGINE_MAX_LEN, max_num_batched_tokens: int = 512,
             adapters: dict | None = None, kv_budget_tokens: int | None = None,
             prefix_cache_tokens: int = 0) -> EngineCore:
        # the session decoder's fused weights and RoPE tables, with this scheduler's own KV cache and adapters
        runner = ModelRunner(real_engine.runner.decoder, slots, max_len, adapters)
        return EngineCore(runner, real_engine.sampler, real_engine.tokenizer, max_num_batched_tokens,
                          kv_budget_tokens, prefix_cache_tokens, check_invariants=True)

    return make
