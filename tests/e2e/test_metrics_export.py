"""Every metric that the Grafana dashboard, the Triton HPA and the prometheus-adapter rules name is one the running
stack exports (Triton's /metrics with the engine's custom metrics, and the gateway's /metrics)."""

from __future__ import annotations

import json
import re

import httpx
import yaml
from prometheus_client.samples import Sample

from devstack.triton import REPO_ROOT
from tests.e2e.conftest import MODEL
from tests.helpers.prometheus import samples, scrape

DEPLOY = REPO_ROOT / "deploy"
_METRIC = re.compile(r"\b((?:sie|nv)_[a-z0-9_]+)\b")


def _named_by_the_deployment() -> dict[str, set[str]]:
    dashboard = json.loads((DEPLOY / "grafana" / "sie-dashboard.json").read_text())
    exprs = [t["expr"] for p in dashboard["panels"] for t in p["targets"]]
    exprs += [dashboard["templating"]["list"][1]["definition"]]
    hpa = yaml.safe_load((DEPLOY / "k8s" / "base" / "triton-hpa.yaml").read_text())
    adapter = yaml.safe_load((DEPLOY / "k8s" / "monitoring" / "prometheus-adapter-values.yaml").read_text())
    return {
        "dashboard": {m for e in exprs for m in _METRIC.findall(e)},
        "hpa": {m["pods"]["metric"]["name"] for m in hpa["spec"]["metrics"]},
        "adapter": {m for rule in adapter["rules"]["custom"] for m in _METRIC.findall(rule["seriesQuery"])},
    }


def test_every_metric_the_dashboard_hpa_and_adapter_name_is_exported(stack):
    reply = httpx.post(stack.base_url + "/v1/chat/completions", timeout=120, json={
        "model": MODEL, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4, "stream": True})
    assert reply.status_code == 200
    # a labelled counter has no series until its first sample: one error for the errors-by-code panel
    assert httpx.post(stack.base_url + "/v1/chat/completions", json={"model": MODEL}, timeout=30).status_code == 400
    exported = samples(scrape(f"http://127.0.0.1:{stack.triton.metrics}/metrics"))
    exported.update(samples(scrape(stack.base_url + "/metrics")))
    named = _named_by_the_deployment()
    assert all(named.values()), named
    for source, names in named.items():
        missing = sorted(n for n in names if n not in exported)
        assert not missing, f"{source} names metrics the stack does not export: {missing}"


def test_engine_metrics_carry_the_model_label_and_vllm_buckets(stack):
    exported = samples(scrape(f"http://127.0.0.1:{stack.triton.metrics}/metrics"))

    def ours(name: str) -> list[Sample]:
        return [s for s in exported[name] if s.labels.get("model") == "smollm2_135m_instruct"]

    for name in ("sie_engine_num_requests_waiting", "sie_engine_kv_cache_usage_perc",
                 "sie_engine_time_to_first_token_seconds_bucket", "sie_engine_generation_tokens_total"):
        assert ours(name), name
    bounds = [float(s.labels["le"]) for s in ours("sie_engine_time_to_first_token_seconds_bucket")]
    assert bounds[:3] == [0.001, 0.005, 0.01] and bounds[-2:] == [2560.0, float("inf")]
    assert "sie_engine_ttft_seconds_last" not in exported and "sie_engine_tpot_seconds_last" not in exported
    # vLLM's cache_config_info, which KV-aware routers read: the block size and the KV budget in blocks
    (info,) = ours("sie_engine_cache_config_info")
    assert info.labels["block_size"] == "16" and int(info.labels["num_gpu_blocks"]) > 0
    assert ours("sie_engine_num_preemptions_total")
