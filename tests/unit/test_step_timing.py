"""The per-step time breakdown (engine/core/step_timing.py): what each phase is charged, which steps count, and
that a real engine's decode steps are all accounted for."""

from __future__ import annotations

import pytest

from engine.core import step_timing
from engine.core.step_timing import PHASES, StepTiming
from engine.sampling_params import SamplingParams

from .engine_run import PROMPTS, Run


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def clock(monkeypatch) -> Clock:
    clock = Clock()
    monkeypatch.setattr(step_timing.time, "perf_counter", clock)
    return clock


def _step(timing: StepTiming, clock: Clock, laps: dict[str, float], batch: int, prefill: bool = False) -> None:
    timing.start()
    for phase, seconds in laps.items():
        clock.now += seconds
        timing.lap(phase)
    if prefill:
        timing.prefilled()
    timing.end(batch)


def test_each_lap_is_charged_to_its_phase_per_batch_size(clock):
    timing = StepTiming()
    _step(timing, clock, {"schedule": 0.001, "stage": 0.0005, "forward": 0.040, "sample": 0.004}, batch=8)
    clock.now += 0.002  # between steps: the loop's own work
    _step(timing, clock, {"schedule": 0.001, "stage": 0.0005, "forward": 0.060, "sample": 0.004}, batch=8)
    _step(timing, clock, {"forward": 0.010}, batch=1)
    eight = timing.summary()[8]
    assert eight["steps"] == 2
    assert eight["forward"] == pytest.approx(50.0)
    assert eight["loop"] == pytest.approx(1.0)  # 2 ms over two steps; the first had no previous step
    assert eight["wall"] == pytest.approx(1.0 + 1.0 + 0.5 + 50.0 + 4.0)
    assert eight["outside_forward"] == pytest.approx(6.5 / 56.5)
    assert timing.summary()[1]["wall"] == pytest.approx(10.0)


def test_prefill_steps_and_idle_gaps_are_not_counted(clock):
    timing = StepTiming()
    _step(timing, clock, {"forward": 0.5}, batch=4, prefill=True)  # a prefill step is not a decode step
    assert timing.summary() == {}
    _step(timing, clock, {"forward": 0.5}, batch=0)  # nothing was decoding: the loop then waits, idle
    clock.now += 30.0
    _step(timing, clock, {"forward": 0.02}, batch=4)
    assert timing.summary()[4]["loop"] == 0.0
    timing.reset()
    assert timing.summary() == {}


def test_a_real_engine_accounts_for_every_decode_step(real_engine):
    from engine.core.engine_core import EngineCore
    from engine.runner.model_runner import ModelRunner

    core = EngineCore(ModelRunner(real_engine.runner.decoder, 4, 256), real_engine.sampler, real_engine.tokenizer)
    prompts = [real_engine.encode_prompt(messages=[{"role": "user", "content": p}]) for p in PROMPTS[:2]]
    run = Run(core)
    for i, prompt in enumerate(prompts):
        run.add(f"r{i}", prompt, SamplingParams(max_tokens=6, ignore_eos=True, temperature=0))
    run.until_done()
    two = core.timing.summary()[2]
    # 6 tokens: the prefill step samples the first (not counted), then 5 pure decode steps
    assert two["steps"] == 5
    assert all(two[phase] >= 0 for phase in PHASES)
    assert two["forward"] > 0 and two["sample"] > 0 and two["outputs"] > 0
    assert two["forward"] < two["wall"]
