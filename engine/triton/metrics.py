"""Engine gauges and counters exported through Triton's custom-metrics API (on Triton's /metrics)."""

from __future__ import annotations

import threading
from typing import Any


class EngineMetrics:
    def __init__(self, pb_utils, engine, model_name: str, period_s: float = 0.5) -> None:
        self.engine = engine
        self._stop = threading.Event()
        labels = {"model": model_name}
        gauge, counter = pb_utils.MetricFamily.GAUGE, pb_utils.MetricFamily.COUNTER

        self._families: list[Any] = []  # a family must outlive its metrics

        def metric(name: str, doc: str, kind):
            family = pb_utils.MetricFamily(name=name, description=doc, kind=kind)
            self._families.append(family)
            return family.Metric(labels=labels)

        self.queue_depth = metric("sie_engine_queue_depth", "Requests waiting for a slot", gauge)
        self.running = metric("sie_engine_running_sequences", "Sequences in the running batch", gauge)
        self.kv_tokens = metric("sie_engine_kv_tokens", "Token positions held in the KV cache", gauge)
        self.generated = metric("sie_engine_generated_tokens_total", "Tokens generated", counter)
        self.cancelled = metric("sie_engine_cancelled_total", "Requests cancelled", counter)
        self.ttft = metric("sie_engine_ttft_seconds_last", "Time to first token of the latest request", gauge)
        self.tpot = metric("sie_engine_tpot_seconds_last", "Time per output token of the latest finished choice",
                           gauge)
        self._sent = {"generated": 0, "cancelled": 0}
        self._thread = threading.Thread(target=self._run, args=(period_s,), name="engine-metrics", daemon=True)
        self._thread.start()

    def _run(self, period_s: float) -> None:
        while not self._stop.wait(period_s):
            try:
                self._update()
            except Exception:  # metrics must never take the model down (e.g. during unload)
                return

    def _update(self) -> None:
        stats = self.engine.scheduler.stats
        self.queue_depth.set(self.engine.scheduler.queue_depth)
        self.running.set(stats.running)
        self.kv_tokens.set(stats.kv_tokens)
        for name, value, metric in (("generated", stats.generated_tokens, self.generated),
                                    ("cancelled", stats.cancelled, self.cancelled)):
            metric.increment(value - self._sent[name])
            self._sent[name] = value
        if stats.ttfts:
            self.ttft.set(stats.ttfts[-1])
        if stats.tpot_last is not None:
            self.tpot.set(stats.tpot_last)

    def stop(self) -> None:
        self._stop.set()
