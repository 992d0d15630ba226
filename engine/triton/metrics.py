"""The engine's metrics on Triton's /metrics, through the Python backend's custom-metrics API (docs/metrics.md).

A thread reads the engine's stats every `period_s`: it sets the gauges, adds the counters' growth and observes the
timings queued since its last read into histograms. The engine thread only appends to its stats: each custom-metric
call is an IPC to the Triton process (about 60 us), paid here.

Every Metric and MetricFamily is released in `stop()` (the model's finalize), while the backend's shared memory is
still there: one left to the interpreter's final garbage collection (the model object sits in a reference cycle
with its engine) crashed the stub in `MetricFamily::~MetricFamily` at every shutdown.
"""

from __future__ import annotations

import logging
import random
import threading
import time
from typing import Any

log = logging.getLogger(__name__)

# vLLM's bucket boundaries (vllm/v1/metrics/loggers.py), so dashboards and SLOs carry over
TTFT_BUCKETS = [0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
                40.0, 80.0, 160.0, 640.0, 2560.0]
ITL_BUCKETS = [0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0,
               80.0]
REQUEST_BUCKETS = [0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0, 240.0,
                   480.0, 960.0, 1920.0, 7680.0]

HISTOGRAMS = {  # EngineStats timing -> (buckets, description)
    "time_to_first_token": (TTFT_BUCKETS, "Arrival in the engine to the first sampled token, seconds"),
    "inter_token_latency": (ITL_BUCKETS, "Between consecutive output tokens of a candidate, seconds"),
    "e2e_request_latency": (REQUEST_BUCKETS, "Arrival in the engine to the request's end, seconds"),
    "request_queue_time": (REQUEST_BUCKETS, "Arrival to admission into the running batch, seconds"),
    "request_prefill_time": (REQUEST_BUCKETS, "Admission to the first token (prompt prefill), seconds"),
}
COUNTERS = {  # metric -> (EngineStats attribute, description)
    "sie_engine_prompt_tokens_total": ("prompt_tokens", "Prompt tokens of admitted requests"),
    "sie_engine_generation_tokens_total": ("generation_tokens", "Tokens sampled"),
    "sie_engine_request_cancelled_total": ("cancelled", "Requests cancelled by their client"),
    "sie_engine_prefix_cache_queries_total": ("prefix_queries", "Prompt tokens looked up in the prefix cache"),
    "sie_engine_prefix_cache_hits_total": ("prefix_hits", "Prompt tokens found in the prefix cache"),
    "sie_engine_num_preemptions_total": ("preemptions", "Running candidates preempted for KV room, recomputed later"),
}
FINISHED = "sie_engine_request_success_total"
# observations per histogram per period past which a uniform sample is observed (inter-token latency on a fast
# device): the percentiles stay right, each observation costs an IPC
MAX_OBSERVED_PER_PERIOD = 1000


class EngineMetrics:
    def __init__(self, pb_utils, engine, model_name: str, period_s: float = 0.5) -> None:
        self.engine = engine
        self._kinds = pb_utils.MetricFamily
        self._labels = {"model": model_name}
        self._families: dict[str, Any] = {}
        self._metrics: list[Any] = []  # every Metric, released before the families
        gauge = self._kinds.GAUGE
        self._gauges = {
            "waiting": self._metric(gauge, "sie_engine_num_requests_waiting",
                                    "Requests waiting in the engine for a slot or KV room"),
            "running": self._metric(gauge, "sie_engine_num_requests_running", "Requests in the running batch"),
            "kv": self._metric(gauge, "sie_engine_kv_cache_usage_perc",
                               "KV blocks in use by running requests over all KV blocks (0..1)"),
        }
        self._counters = {attr: self._metric(self._kinds.COUNTER, name, doc) for name, (attr, doc) in COUNTERS.items()}
        # preemptions by cause, and requests by priority band (three bands whatever the priorities: bounded)
        self._by_cause = {cause: self._metric(self._kinds.COUNTER, "sie_engine_num_preemptions_by_cause_total",
                                              "Preemptions by cause: kv (blocks ran out), priority (outranked)",
                                              cause=cause) for cause in engine.stats.preemptions_by_cause}
        self._bands = {(state, band): self._metric(gauge, f"sie_engine_num_requests_{state}_by_priority",
                                                   f"Requests {state} in the engine by priority band "
                                                   "(high < 0, default 0, low > 0)", priority_band=band)
                       for state in ("running", "waiting") for band in engine.stats.running_by_band}
        # vLLM's cache_config_info: KV-aware routers and autoscalers read the block size and count from its labels
        self._cache_info = self._metric(gauge, "sie_engine_cache_config_info", "KV cache configuration (value 1)",
                                        **engine.cache_config)
        self._cache_info.set(1)
        # one series per reason from the start (stop, length, error, cancelled): a rate needs its zero
        self._finished = {reason: self._finished_metric(reason) for reason in engine.stats.finished}
        self._histograms = {
            timing: self._metric(self._kinds.HISTOGRAM, f"sie_engine_{timing}_seconds", doc, buckets=buckets)
            for timing, (buckets, doc) in HISTOGRAMS.items()
        }
        # where a pure decode step's time goes (engine/core/step_timing.py): seconds by phase, and the steps, so a
        # dashboard divides the two for the step budget (ms a step by phase) on the served engine
        self._step_seconds = {phase: self._metric(self._kinds.COUNTER, "sie_engine_decode_step_seconds_total",
                                                  "Seconds of pure decode steps, by phase", phase=phase)
                              for phase in engine.step_timing.totals() if phase != "steps"}
        self._steps = self._metric(self._kinds.COUNTER, "sie_engine_decode_steps_total",
                                   "Pure decode steps (steps that prefill nothing)")
        # vLLM's lora_requests_info: its labels say which adapters running and waiting requests use; a new label set
        # is a new series valued with the time it was seen, and the old series is dropped (bounded cardinality)
        self._lora_info: Any = None
        self._lora_labels: dict[str, str] | None = None
        self._counted: dict[str, float] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, args=(period_s,), name="engine-metrics", daemon=True)
        self._thread.start()

    def _metric(self, kind, name: str, doc: str, buckets: list[float] | None = None, **labels: str):
        family = self._families.get(name)
        if family is None:
            family = self._families[name] = self._kinds(name=name, description=doc, kind=kind)
        extra = {"buckets": buckets} if buckets is not None else {}
        metric = family.Metric(labels={**self._labels, **labels}, **extra)
        self._metrics.append(metric)
        return metric

    def _finished_metric(self, reason: str):
        return self._metric(self._kinds.COUNTER, FINISHED, "Finished requests by finish reason",
                            finished_reason=reason)

    def _run(self, period_s: float) -> None:
        failures = 0
        while not self._stop.wait(period_s):
            try:
                self.update()
            except Exception:  # metrics must never take the model down
                failures += 1
                if failures == 1:
                    log.exception("exporting engine metrics failed")

    def update(self) -> None:
        stats = self.engine.stats
        self._gauges["waiting"].set(self.engine.num_waiting)
        self._gauges["running"].set(stats.running)
        self._gauges["kv"].set(stats.kv_usage)
        for attr, metric in self._counters.items():
            self._add(attr, metric, getattr(stats, attr))
        for cause, metric in self._by_cause.items():
            self._add(f"cause:{cause}", metric, stats.preemptions_by_cause[cause])
        for state, counts in (("running", stats.running_by_band), ("waiting", stats.waiting_by_band)):
            for band, value in counts.items():
                self._bands[(state, band)].set(value)
        for reason, value in dict(stats.finished).items():  # a copy: the engine thread may add a reason
            if reason not in self._finished:
                self._finished[reason] = self._finished_metric(reason)
            self._add(f"finished:{reason}", self._finished[reason], value)
        self._update_lora_info()
        totals = self.engine.step_timing.totals()
        self._add("steps", self._steps, totals["steps"])
        for phase, metric in self._step_seconds.items():
            self._add(f"step:{phase}", metric, totals[phase])
        for timing, histogram in self._histograms.items():
            values = stats.drain(timing)
            if len(values) > MAX_OBSERVED_PER_PERIOD:
                values = random.sample(values, MAX_OBSERVED_PER_PERIOD)
            for seconds in values:
                histogram.observe(seconds)

    def _update_lora_info(self) -> None:
        labels = self.engine.lora_requests_info()
        if labels == self._lora_labels:
            return
        old, self._lora_labels = self._lora_info, labels
        self._lora_info = self._metric(self._kinds.GAUGE, "sie_engine_lora_requests_info",
                                       "LoRA adapters of the running and waiting requests (value: when seen, unix s)",
                                       **labels)
        self._lora_info.set(time.time())
        if old is not None:  # the backend deletes the series with its last reference
            self._metrics.remove(old)

    def _add(self, key: str, metric, value: float) -> None:
        grown = value - self._counted.get(key, 0)
        if grown > 0:
            metric.increment(grown)
            self._counted[key] = value

    def stop(self) -> None:
        """Stop exporting and release every metric now, while the backend can still delete them."""
        self._stop.set()
        self._thread.join(timeout=5)
        self._gauges.clear()
        self._counters.clear()
        self._finished.clear()
        self._histograms.clear()
        self._step_seconds.clear()
        self._by_cause.clear()
        self._bands.clear()
        self._steps = None
        self._lora_info = None
        self._cache_info = None
        self._metrics.clear()  # the metrics go first: a family must outlive its metrics
        self._families.clear()
