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
    from engine.llm_engine import EngineConfig, LLMEngine

    engine = LLMEngine(EngineConfig(str(MODEL_DIR), max_slots=2, max_len=64))
    fatal = threading.Event()
    engine.on_fatal = fatal.set

    def broken_step() -> None:
        raise RuntimeError("simulated kernel failure")

    engine.core.step = broken_step
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


def test_requests_still_queued_when_the_loop_dies_get_a_final_error():
    """A request submitted while the loop was inside its fatal step sits in the intake queue, not the
    scheduler: it must be failed too, not left without a final response."""
    _require_model()
    from engine.llm_engine import EngineConfig, LLMEngine

    engine = LLMEngine(EngineConfig(str(MODEL_DIR), max_slots=2, max_len=64))
    late: list = []

    def step_that_races_a_submit_then_dies() -> None:
        late.append(engine.generate("late", engine.encode_prompt(prompt="Hi"), SamplingParams(max_tokens=2)))
        raise RuntimeError("simulated kernel failure")

    engine.core.step = step_that_races_a_submit_then_dies
    engine.start()
    try:
        first = engine.generate("first", engine.encode_prompt(prompt="Hello"), SamplingParams(max_tokens=4))
        assert first.get(timeout=30).error.code == "inference_error"
        out = late[0].get(timeout=10)
        assert out.final and out.error is not None and out.error.code == "inference_error"
    finally:
        engine.stop()


def test_an_unexpected_error_admitting_one_request_fails_only_that_request(real_engine, monkeypatch):
    """A bug in admission (any exception, not only EngineError) fails that request; the loop lives on."""
    real_add = real_engine.core.scheduler.add

    def add(request) -> None:
        if request.request_id == "bad":
            raise KeyError("simulated admission bug")
        real_add(request)

    monkeypatch.setattr(real_engine.core.scheduler, "add", add)
    bad = real_engine.generate("bad", real_engine.encode_prompt(prompt="Hello"), SamplingParams(max_tokens=2))
    out = bad.get(timeout=30)
    assert out.final and out.error is not None and out.error.code == "inference_error"
    good = real_engine.generate("good", real_engine.encode_prompt(prompt="Hello"), SamplingParams(max_tokens=2))
    while not (out := good.get(timeout=60)).final:
        pass
    assert out.error is None and out.finish_reason in ("stop", "length")
    assert real_engine.healthy
