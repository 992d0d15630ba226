"""The engine's gauges under vLLM's names, as an endpoint picker's built-in vLLM mapping reads them."""

from __future__ import annotations

from prometheus_client.parser import text_string_to_metric_families

from gateway.engine_gauges import as_vllm

TRITON = """\
# HELP sie_engine_num_requests_waiting Requests waiting in the engine for a slot or KV room
# TYPE sie_engine_num_requests_waiting gauge
sie_engine_num_requests_waiting{model="smollm2_135m_instruct"} 3
# HELP sie_engine_kv_cache_usage_perc KV blocks in use by running requests over all KV blocks (0..1)
# TYPE sie_engine_kv_cache_usage_perc gauge
sie_engine_kv_cache_usage_perc{model="smollm2_135m_instruct"} 0.25
# HELP sie_engine_cache_config_info KV cache configuration (value 1)
# TYPE sie_engine_cache_config_info gauge
sie_engine_cache_config_info{block_size="16",enable_prefix_caching="true",model="smollm2_135m_instruct",\
num_gpu_blocks="4096"} 1
# HELP sie_engine_num_preemptions_total Running candidates preempted for KV room, recomputed later
# TYPE sie_engine_num_preemptions_total counter
sie_engine_num_preemptions_total{model="smollm2_135m_instruct"} 7
# HELP nv_inference_count Number of inferences performed
# TYPE nv_inference_count counter
nv_inference_count{model="smollm2_135m_instruct",version="1"} 12
"""


def test_engine_gauges_carry_vllms_names_and_the_served_model_name():
    text = as_vllm(TRITON, {"smollm2_135m_instruct": "HuggingFaceTB/SmolLM2-135M-Instruct"})
    families = {f.name: f for f in text_string_to_metric_families(text)}
    assert set(families) == {"vllm:num_requests_waiting", "vllm:kv_cache_usage_perc", "vllm:cache_config_info",
                             "vllm:num_preemptions"}
    (waiting,) = families["vllm:num_requests_waiting"].samples
    assert waiting.value == 3 and waiting.labels == {"model_name": "HuggingFaceTB/SmolLM2-135M-Instruct"}
    assert families["vllm:kv_cache_usage_perc"].samples[0].value == 0.25
    (info,) = families["vllm:cache_config_info"].samples
    assert (info.labels["block_size"], info.labels["num_gpu_blocks"]) == ("16", "4096")
    (preempted,) = families["vllm:num_preemptions"].samples
    assert preempted.name == "vllm:num_preemptions_total" and preempted.value == 7
    assert "nv_inference_count" not in text  # only the engine's own gauges


def test_nothing_to_rename_is_an_empty_page():
    assert as_vllm("# TYPE nv_inference_count counter\nnv_inference_count 1\n", {}) == ""


class _Profile:
    triton_model, name = "smollm2_135m_instruct", "HuggingFaceTB/SmolLM2-135M-Instruct"


class _Registry:
    def profiles(self):
        return [_Profile()]


class _Resp:
    data: bytes = b""
    content_type: str = ""


def _serve(body: bytes):
    """A local HTTP server answering every GET with `body` (the pod's Triton metrics endpoint)."""
    import http.server
    import threading

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            self.send_response(200)
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args):
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server


def test_the_gateways_metrics_page_carries_the_pods_engine_gauges():
    import asyncio

    from gateway.resources.health import MetricsResource

    server = _serve(TRITON.encode())
    try:
        url = f"http://127.0.0.1:{server.server_address[1]}/metrics"
        resp = _Resp()
        asyncio.run(MetricsResource(url, _Registry()).on_get(None, resp))
    finally:
        server.shutdown()
    text = resp.data.decode()
    assert 'vllm:num_requests_waiting{model_name="HuggingFaceTB/SmolLM2-135M-Instruct"} 3' in text
    assert "vllm:kv_cache_usage_perc" in text and "sie_gateway_" in text  # the gateway's own metrics stay


def test_an_unreachable_engine_leaves_the_gauges_out_rather_than_stale():
    import asyncio

    from gateway.resources.health import MetricsResource

    resp = _Resp()
    asyncio.run(MetricsResource("http://127.0.0.1:9/metrics", _Registry()).on_get(None, resp))
    assert b"vllm:" not in resp.data and resp.data
