"""The engine's metrics: what the scheduler records (real SmolLM2, synchronous scheduler), and how the Triton glue
exports it (engine/triton/metrics.py against a recording stand-in for the backend's MetricFamily API)."""

from __future__ import annotations

import threading
import time
import weakref

import pytest

from engine.core.kv_manager import BLOCK_TOKENS, blocks
from engine.core.stats import EngineStats
from engine.core.step_timing import PHASES, StepTiming
from engine.sampling_params import SamplingParams
from engine.triton.metrics import ITL_BUCKETS, MAX_OBSERVED_PER_PERIOD, TTFT_BUCKETS, EngineMetrics

from .engine_run import PROMPTS, Run

# -- what the scheduler records -------------------------------------------------------------------


@pytest.fixture(scope="module")
def prompts(real_engine) -> list[list[int]]:
    return [real_engine.encode_prompt(messages=[{"role": "user", "content": p}]) for p in PROMPTS]


@pytest.fixture
def cached(real_engine):
    from engine.core.engine_core import EngineCore
    from engine.runner.model_runner import ModelRunner

    runner = ModelRunner(real_engine.runner.decoder, 8, 256)
    return EngineCore(runner, real_engine.sampler, real_engine.tokenizer, kv_budget_tokens=1000,
                      prefix_cache_tokens=2048)


def test_scheduler_records_counters_gauges_and_timings(cached, prompts):
    started = time.monotonic()
    run = Run(cached)
    run.add("a", prompts[0], SamplingParams(max_tokens=6, ignore_eos=True, temperature=0))
    run.add("b", prompts[1], SamplingParams(max_tokens=4, ignore_eos=True, temperature=0, n=2))
    run.step()
    stats: EngineStats = cached.stats
    assert stats.running == 2  # requests, not candidates (b has two)
    # one step prefilled both and decoded every row once: each row holds its prompt and first token, and b's two
    # candidates share the prompt's full blocks
    used = blocks(len(prompts[0]) + 1) + 2 * blocks(len(prompts[1]) + 1) - len(prompts[1]) // BLOCK_TOKENS
    assert stats.kv_usage == pytest.approx(used / (1000 // BLOCK_TOKENS))
    run.until_done()
    elapsed = time.monotonic() - started
    assert stats.running == 0 and stats.kv_usage == 0
    assert stats.prompt_tokens == len(prompts[0]) + len(prompts[1])
    assert stats.generation_tokens == 6 + 2 * 4
    assert stats.finished["length"] == 2
    assert [len(stats.drain(t)) for t in ("time_to_first_token", "request_queue_time", "request_prefill_time",
                                          "e2e_request_latency")] == [2, 2, 2, 2]
    itl = stats.drain("inter_token_latency")
    assert len(itl) == (6 - 1) + 2 * (4 - 1)  # one per token after each candidate's first
    assert all(0 <= v <= elapsed for v in itl)  # (the first decode step may warm kernels up: no tighter bound)
    assert stats.drain("inter_token_latency") == []  # drained

    # the same prompt again: its prefix is found in the cache (queried and hit, in tokens)
    queried, hits = stats.prefix_queries, stats.prefix_hits
    assert queried == stats.prompt_tokens and hits == 0
    run.add("again", prompts[0], SamplingParams(max_tokens=2, temperature=0))
    run.until_done()
    assert stats.prefix_queries == queried + len(prompts[0])
    assert 0 < stats.prefix_hits - hits <= len(prompts[0])


def test_cancelled_and_failed_requests_count_by_reason(make_scheduler, prompts):
    sched = make_scheduler()
    run = Run(sched)
    cancelled = threading.Event()
    run.add("gone", prompts[0], SamplingParams(max_tokens=50, ignore_eos=True), is_cancelled=cancelled.is_set)
    run.step()
    cancelled.set()
    run.until_done()
    assert sched.stats.cancelled == 1 and sched.stats.finished["cancelled"] == 1
    assert sched.stats.finished["length"] == 0 and sched.stats.drain("e2e_request_latency") == []


# -- how the Triton glue exports it ----------------------------------------------------------------


class Backend:
    """Stands in for triton_python_backend_utils' MetricFamily: records values and deletion order."""

    def __init__(self) -> None:
        self.deleted: list[str] = []
        self.families: dict[str, Family] = {}
        backend = self

        class MetricFamily(Family):
            COUNTER, GAUGE, HISTOGRAM = "counter", "gauge", "histogram"

            def __init__(self, name: str, description: str, kind: str) -> None:
                super().__init__(backend, name, kind)
                backend.families[name] = self

        self.MetricFamily = MetricFamily

    def value(self, name: str, **labels: str):
        (metric,) = [m for m in self.families[name].live() if labels.items() <= m.labels.items()]
        return metric.value


class Family:
    """Like pb_utils': a family and its metrics hold no Python references to each other."""

    def __init__(self, backend: Backend, name: str, kind: str) -> None:
        self.backend, self.name, self.kind = backend, name, kind
        self.metrics: list[weakref.ref[Metric]] = []

    def Metric(self, labels: dict[str, str], buckets: list[float] | None = None):
        assert (buckets is not None) == (self.kind == "histogram")
        metric = Metric(self, labels, buckets)
        self.metrics.append(weakref.ref(metric))
        return metric

    def live(self) -> list[Metric]:
        return [m for m in (ref() for ref in self.metrics) if m is not None]

    def __del__(self) -> None:
        self.backend.deleted.append(f"family {self.name}")


class Metric:
    def __init__(self, family: Family, labels: dict[str, str], buckets) -> None:
        self.labels, self.buckets = labels, buckets
        self.value: object = [] if buckets is not None else 0
        self.backend, self.name = family.backend, family.name

    def set(self, value: float) -> None:
        self.value = value

    def increment(self, value: float) -> None:
        assert value > 0
        self.value += value  # type: ignore[operator]

    def observe(self, value: float) -> None:
        self.value.append(value)  # type: ignore[union-attr]

    def __del__(self) -> None:
        self.backend.deleted.append(f"metric {self.name}")


class FakeEngine:
    def __init__(self) -> None:
        self.stats = EngineStats(kv_budget=100)
        self.step_timing = StepTiming()
        self.num_waiting = 0
        self.cache_config = {"block_size": "16", "num_gpu_blocks": "100", "enable_prefix_caching": "true"}
        self.lora_info = {"max_lora": "8", "running_lora_adapters": "", "waiting_lora_adapters": ""}

    def lora_requests_info(self) -> dict[str, str]:
        return dict(self.lora_info)


@pytest.fixture
def exported():
    backend, engine = Backend(), FakeEngine()
    metrics = EngineMetrics(backend, engine, "m1", period_s=3600)  # the test calls update() itself
    yield backend, engine, metrics
    metrics.stop()


def test_gauges_counters_and_histograms_with_the_model_label(exported):
    backend, engine, metrics = exported
    stats = engine.stats
    engine.num_waiting, stats.running, stats.kv_used = 3, 2, 25
    stats.prompt_tokens, stats.generation_tokens, stats.prefix_queries, stats.prefix_hits = 40, 7, 40, 16
    stats.finish("stop")
    stats.observe("time_to_first_token", 0.12)
    stats.observe("inter_token_latency", 0.03)
    metrics.update()
    assert backend.value("sie_engine_num_requests_waiting", model="m1") == 3
    assert backend.value("sie_engine_num_requests_running", model="m1") == 2
    assert backend.value("sie_engine_kv_cache_usage_perc", model="m1") == 0.25
    assert backend.value("sie_engine_cache_config_info", model="m1", block_size="16", num_gpu_blocks="100") == 1
    assert backend.value("sie_engine_generation_tokens_total", model="m1") == 7
    assert backend.value("sie_engine_prefix_cache_hits_total", model="m1") == 16
    assert backend.value("sie_engine_request_success_total", finished_reason="stop") == 1
    assert backend.value("sie_engine_request_success_total", finished_reason="length") == 0
    assert backend.value("sie_engine_time_to_first_token_seconds") == [0.12]
    assert backend.value("sie_engine_inter_token_latency_seconds") == [0.03]
    (ttft,) = backend.families["sie_engine_time_to_first_token_seconds"].live()
    assert ttft.buckets == TTFT_BUCKETS and ttft.labels == {"model": "m1"}
    assert backend.families["sie_engine_inter_token_latency_seconds"].live()[0].buckets == ITL_BUCKETS

    # counters add only their growth; a reason seen for the first time gets its own series
    stats.generation_tokens = 10
    stats.finish("tool_calls")
    metrics.update()
    assert backend.value("sie_engine_generation_tokens_total", model="m1") == 10
    assert backend.value("sie_engine_request_success_total", finished_reason="tool_calls") == 1
    assert backend.value("sie_engine_time_to_first_token_seconds") == [0.12]  # observed once
    assert not any(name.endswith("_last") for name in backend.families)


def test_lora_requests_info_follows_the_adapters_in_use_with_one_series(exported):
    backend, engine, metrics = exported
    metrics.update()
    family = backend.families["sie_engine_lora_requests_info"]
    (series,) = family.live()
    assert series.labels == {"model": "m1", "max_lora": "8", "running_lora_adapters": "", "waiting_lora_adapters": ""}
    engine.lora_info.update(running_lora_adapters="a,b", waiting_lora_adapters="c")
    del series
    metrics.update()
    (series,) = family.live()  # the old label set is gone
    assert series.labels["running_lora_adapters"] == "a,b" and series.labels["waiting_lora_adapters"] == "c"
    assert series.value > 1.7e9  # when it was seen, as vLLM sets it


class _StepClock:
    """The step timing's clock, moved by the test: each phase takes exactly what the test says, on any box."""

    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def _decode_step(timing: StepTiming, clock: _StepClock, batch: int, forward_s: float) -> None:
    timing.start()
    timing.lap("schedule")
    clock.now += forward_s
    timing.lap("forward")
    timing.end(batch)


def test_decode_step_time_by_phase_adds_up_across_batch_sizes(exported, monkeypatch):
    """The step budget on the served engine: a dashboard divides seconds by phase by the steps."""
    from engine.core import step_timing

    clock = _StepClock()
    monkeypatch.setattr(step_timing.time, "perf_counter", clock)
    backend, engine, metrics = exported
    metrics.update()
    assert backend.value("sie_engine_decode_steps_total", model="m1") == 0
    _decode_step(engine.step_timing, clock, 1, 0.01)
    _decode_step(engine.step_timing, clock, 8, 0.02)
    engine.step_timing.start()  # a step that prefills is not a decode step: not counted
    engine.step_timing.prefilled()
    engine.step_timing.lap("forward")
    engine.step_timing.end(8)
    metrics.update()
    assert backend.value("sie_engine_decode_steps_total", model="m1") == 2
    forward = backend.value("sie_engine_decode_step_seconds_total", phase="forward")
    assert forward == pytest.approx(0.03)
    assert {m.labels["phase"] for m in backend.families["sie_engine_decode_step_seconds_total"].live()} == set(PHASES)
    _decode_step(engine.step_timing, clock, 8, 0.02)
    metrics.update()  # only the growth is added
    assert backend.value("sie_engine_decode_steps_total", model="m1") == 3
    assert backend.value("sie_engine_decode_step_seconds_total", phase="forward") == pytest.approx(0.05)


def test_a_flood_of_timings_is_sampled_not_queued(exported):
    backend, engine, metrics = exported
    for _ in range(5000):
        engine.stats.observe("inter_token_latency", 0.02)
    metrics.update()
    assert len(backend.value("sie_engine_inter_token_latency_seconds")) == MAX_OBSERVED_PER_PERIOD
    metrics.update()
    assert len(backend.value("sie_engine_inter_token_latency_seconds")) == MAX_OBSERVED_PER_PERIOD


def test_stop_releases_every_metric_then_every_family(exported):
    """The stub crashed when a family was left to the interpreter's final GC (a segfault at shutdown): `stop()` (the
    model's finalize) must release them all, metrics before their families, with the model object still alive."""
    backend, engine, metrics = exported
    metrics.update()
    families = len(backend.families)
    created = sum(len(family.metrics) for family in backend.families.values())
    backend.families.clear()  # only the exporter holds them now
    cycle = [metrics]
    cycle.append(cycle)  # the model object sits in a reference cycle: refcounting alone would never free it
    metrics.stop()
    kinds = [entry.split()[0] for entry in backend.deleted]
    assert kinds.count("family") == families
    assert kinds.count("metric") == created  # every one of them, each metric attribute included
    assert kinds.index("family") > max(i for i, k in enumerate(kinds) if k == "metric")
    assert not metrics._thread.is_alive()
