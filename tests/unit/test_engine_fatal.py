"""A crashed engine loop fails its requests with a clear error, reports itself unhealthy and signals
the glue (which then ends the model process so Triton marks the model not ready)."""

from __future__ import annotations

import threading

import pytest

from engine.errors import EngineError
from engine.sampling_params import SamplingParams
from tests.unit.conftest import MODEL_DIR, _require_model


def test_crashed_loop_fails_requests_and_signals_fatal():
    _require_model()
    from engine.engine import EngineConfig, LLMEngine

    engine = LLMEngine(EngineConfig(str(MODEL_DIR), max_slots=2, max_len=64))
    fatal = threading.Event()
    engine.on_fatal = fatal.set

    def broken_step() -> None:
        raise RuntimeError("simulated kernel failure")

    engine.scheduler.step = broken_step
    engine.start()
    try:
        outputs = engine.generate("r", engine.encode_prompt(prompt="Hello"), SamplingParams(max_tokens=4))
        out = outputs.get(timeout=30)
        assert out.final and out.error is not None and out.error.code == "inference_error"
        assert fatal.wait(5)
        assert engine.healthy is False
        with pytest.raises(EngineError) as info:
            engine.generate("again", engine.encode_prompt(prompt="Hi"), SamplingParams(max_tokens=2))
        assert info.value.code == "MODEL_LOADING"
    finally:
        engine.stop()
