"""The inference-pool pod's serving port, on the real stack: the gateway beside its own tritonserver answers chat and
serves, on the same port's /metrics, the gauges an endpoint picker (llm-d's router, the Gateway API Inference
Extension's EPP) scrapes, under vLLM's names so its built-in vLLM mapping reads them (gateway/engine_gauges.py).
They follow the engine within a scrape: a request running shows, and is gone once it ends.
"""

from __future__ import annotations

import openai

from devstack.stack import LocalStack
from tests.helpers.prometheus import samples, scrape
from tests.helpers.waiting import wait_until

from .conftest import MODEL

# the model-server protocol's gauges (docs/deploy.md, "As an InferencePool backend") and the labels it reads
PROTOCOL = {"vllm:num_requests_waiting": set(), "vllm:num_requests_running": set(),
            "vllm:kv_cache_usage_perc": set(), "vllm:cache_config_info": {"block_size", "num_gpu_blocks"},
            "vllm:lora_requests_info": {"max_lora", "running_lora_adapters", "waiting_lora_adapters"}}


def _gauge(stack: LocalStack, name: str) -> float:
    (sample,) = samples(scrape(f"{stack.base_url}/metrics")).get(name, [])
    return sample.value


def test_the_serving_port_has_the_protocols_gauges_under_vllms_names(pod: LocalStack):
    page = samples(scrape(f"{pod.base_url}/metrics"))
    for name, labels in PROTOCOL.items():
        (sample,) = page.get(name, [None])
        assert sample is not None, f"{name} is missing from the gateway's /metrics"
        assert sample.labels.get("model_name") == MODEL
        assert labels <= set(sample.labels), (name, sample.labels)
    config = page["vllm:cache_config_info"][0].labels
    assert config["block_size"] == "16" and int(config["num_gpu_blocks"]) > 0
    assert 0 <= page["vllm:kv_cache_usage_perc"][0].value <= 1


def test_a_running_request_shows_in_the_gauges_and_leaves_them_when_it_ends(pod: LocalStack):
    client = openai.OpenAI(base_url=f"{pod.base_url}/v1", api_key="none", max_retries=0, timeout=120)
    stream = client.chat.completions.create(
        model=MODEL, stream=True, max_tokens=512, temperature=0,
        messages=[{"role": "user", "content": "Write a long story about a dragon who learns to sail."}])
    chunks = iter(stream)
    assert next(chunks).choices is not None  # chat answers through the pod's gateway
    try:
        wait_until(lambda: _gauge(pod, "vllm:num_requests_running"), 10,
                   "the running request never showed in vllm:num_requests_running", until=lambda v: v >= 1)
        assert _gauge(pod, "vllm:kv_cache_usage_perc") > 0
    finally:
        stream.close()  # the client leaves: the gateway cancels the request
    wait_until(lambda: _gauge(pod, "vllm:num_requests_running"), 10,
               "vllm:num_requests_running stayed above 0 after the request ended", until=lambda v: v == 0)
