"""The engine's gauges under vLLM's metric names on the gateway's own /metrics: what a Gateway API Inference
Extension endpoint picker (llm-d's router) scrapes from a model-server pod.

In the pod layout the gateway runs beside its own tritonserver and serves OpenAI HTTP on the pod's target port; the
picker scrapes that same port. So `/metrics` appends, at each scrape, the engine's gauges read from the local
Triton's metrics endpoint (`SIE_ENGINE_METRICS_URL`), renamed to vLLM's names, which the picker's built-in vLLM
mapping reads with no configuration: queue (`vllm:num_requests_waiting`), running (`vllm:num_requests_running`),
KV use as a fraction (`vllm:kv_cache_usage_perc`), the block size and count (`vllm:cache_config_info`), LoRA
adapters (`vllm:lora_requests_info`) and preemptions. Read at scrape time, they are never staler than the scrape
itself: a picker treats a pod with stale or missing gauges as saturated. When Triton does not answer within the
timeout, the gauges are left out (and the picker sees the pod as unavailable, which it is). Our own names stay on
Triton's endpoint as they are (docs/metrics.md).
"""

from __future__ import annotations

import logging

import httpx
from prometheus_client.parser import text_string_to_metric_families

log = logging.getLogger(__name__)

VLLM_NAMES = {  # engine metric (Triton) -> vLLM's name and type
    "sie_engine_num_requests_waiting": ("vllm:num_requests_waiting", "gauge"),
    "sie_engine_num_requests_running": ("vllm:num_requests_running", "gauge"),
    "sie_engine_kv_cache_usage_perc": ("vllm:kv_cache_usage_perc", "gauge"),
    "sie_engine_cache_config_info": ("vllm:cache_config_info", "gauge"),
    "sie_engine_lora_requests_info": ("vllm:lora_requests_info", "gauge"),
    "sie_engine_num_preemptions": ("vllm:num_preemptions", "counter"),
}


def _label_text(labels: dict[str, str]) -> str:
    if not labels:
        return ""
    escaped = (f'{k}="{v}"'.replace("\\", "\\\\").replace("\n", "\\n") for k, v in sorted(labels.items()))
    return "{" + ",".join(escaped) + "}"


def as_vllm(triton_text: str, served_names: dict[str, str]) -> str:
    """Triton's exposition text -> the engine gauges under vLLM's names, one family each, the `model` label (the
    Triton model) renamed to vLLM's `model_name` with the served name (`served_names`: Triton name -> served)."""
    lines: list[str] = []
    for family in text_string_to_metric_families(triton_text):
        target = VLLM_NAMES.get(family.name)
        if target is None:
            continue
        name, kind = target
        name += "_total" if kind == "counter" else ""  # as prometheus_client writes a counter's family
        lines.append(f"# HELP {name} {family.documentation}")
        lines.append(f"# TYPE {name} {kind}")
        for sample in family.samples:
            if sample.name.endswith("_created"):
                continue
            labels = dict(sample.labels)
            model = labels.pop("model", None)
            if model is not None:
                labels["model_name"] = served_names.get(model, model)
            lines.append(f"{name}{_label_text(labels)} {sample.value}")
    return "\n".join(lines) + ("\n" if lines else "")


async def scrape(url: str, served_names: dict[str, str], timeout_s: float = 0.5) -> str:
    """The local engine's gauges under vLLM's names, read now; empty when Triton does not answer in time."""
    try:
        async with httpx.AsyncClient(timeout=timeout_s) as client:
            response = await client.get(url)
            response.raise_for_status()
    except httpx.HTTPError as exc:
        log.warning("engine metrics unreadable at %s: %s", url, type(exc).__name__)
        return ""
    return as_vllm(response.text, served_names)
