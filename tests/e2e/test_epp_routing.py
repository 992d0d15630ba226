"""llm-d's endpoint picker (EPP) routes to our pod by the gauges on its serving port, where an `epp` binary exists.

The EPP runs in file-discovery mode, with no cluster (upstream's cmd/epp/runner/run_with_file_discovery_test.go does
the same), over two endpoints on 127.0.0.1: our pod (the gateway beside its own Triton, the engine's gauges under
vLLM's names on its /metrics, docs/deploy.md) and a stand-in whose /metrics says it is saturated (a queue of 1000,
its KV full). With the queue and KV-cache scorers and the max-score picker, every chat request the test sends as
Envoy would (ext_proc over gRPC, the stubs of PyPI's xds-protos) must be routed to our pod, and the chat then
answers there. So the EPP read our gauges with its built-in vLLM mapping.

Where no `epp` binary is on PATH the test skips saying so: the one skip tests/conftest.py keeps under CI=true, since
the EPP is Go and these machines cannot fetch Go modules (build llm-d/llm-d-router's ./cmd/epp elsewhere).
"""

from __future__ import annotations

import http.server
import json
import shutil
import socket
import subprocess
import threading
import time
from collections.abc import Iterator

import httpx
import pytest

from devstack.children import start_child
from devstack.net import free_port
from devstack.serve import stop
from devstack.stack import LocalStack

from .conftest import MODEL

EPP = shutil.which("epp")
pytestmark = pytest.mark.skipif(EPP is None, reason="llm-d's endpoint picker runs this test: no `epp` binary on PATH "
                                 "(build llm-d/llm-d-router ./cmd/epp where the Go module proxy is reachable)")

SATURATED = "\n".join([
    "# TYPE vllm:num_requests_waiting gauge", f'vllm:num_requests_waiting{{model_name="{MODEL}"}} 1000',
    "# TYPE vllm:num_requests_running gauge", f'vllm:num_requests_running{{model_name="{MODEL}"}} 64',
    "# TYPE vllm:kv_cache_usage_perc gauge", f'vllm:kv_cache_usage_perc{{model_name="{MODEL}"}} 1.0', ""])

CONFIG = """apiVersion: llm-d.ai/v1alpha1
kind: EndpointPickerConfig
plugins:
  - name: file-discovery
    type: file-discovery
    parameters:
      path: "{endpoints}"
      watchFile: false
  - name: queue-scorer
    type: queue-scorer
  - name: kv-cache-utilization-scorer
    type: kv-cache-utilization-scorer
  - name: max-score-picker
    type: max-score-picker
  - name: single-profile-handler
    type: single-profile-handler
  - name: metrics-source
    type: metrics-data-source
  - name: metrics-extractor
    type: core-metrics-extractor
schedulingProfiles:
  - name: default
    plugins:
      - pluginRef: queue-scorer
      - pluginRef: kv-cache-utilization-scorer
      - pluginRef: max-score-picker
dataLayer:
  injectDefaults: false
  discovery:
    pluginRef: file-discovery
  sources:
    - pluginRef: metrics-source
      extractors:
        - pluginRef: metrics-extractor
"""


class _Saturated(http.server.BaseHTTPRequestHandler):
    def do_GET(self) -> None:
        body = SATURATED.encode()
        self.send_response(200)
        self.send_header("Content-Type", "text/plain; version=0.0.4")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args) -> None:
        pass


@pytest.fixture(scope="module")
def saturated() -> Iterator[int]:
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Saturated)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield server.server_address[1]
    server.shutdown()


@pytest.fixture(scope="module")
def epp(pod: LocalStack, saturated: int, tmp_path_factory) -> Iterator[int]:
    """The EPP over both endpoints; its ext_proc port."""
    folder = tmp_path_factory.mktemp("epp")
    endpoints = folder / "endpoints.yaml"
    entries = [("ours", pod.gateway_port), ("saturated", saturated)]
    endpoints.write_text("endpoints:\n" + "".join(
        f'  - name: {name}\n    namespace: default\n    address: 127.0.0.1\n    port: "{port}"\n'
        f'    labels:\n      llm-d.ai/engine-type: vllm\n' for name, port in entries))
    grpc_port, health_port, metrics_port = free_port(), free_port(), free_port()
    log = open(folder / "epp.log", "w")  # noqa: SIM115 (closed after the process)
    proc = start_child(
        [EPP, "--config-text", CONFIG.format(endpoints=endpoints), "--pool-name", "sie-pool", "--pool-namespace",
         "default", "--secure-serving=false", "--tracing=false", "--grpc-port", str(grpc_port),
         "--grpc-health-port", str(health_port), "--metrics-port", str(metrics_port)],
        stdout=log, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 60
        while True:
            assert proc.poll() is None, (folder / "epp.log").read_text()[-3000:]
            try:
                socket.create_connection(("127.0.0.1", grpc_port), timeout=1).close()
                break
            except OSError:
                assert time.monotonic() < deadline, "the EPP's ext_proc port never opened"
                time.sleep(0.2)
        time.sleep(2)  # a few of its 50 ms scrapes of both endpoints' /metrics
        yield grpc_port
    finally:
        stop(proc)
        log.close()


def _picked(grpc_port: int, body: dict) -> str:
    """The endpoint the EPP picks for one chat request, asked as Envoy asks: request headers, then the body."""
    try:
        import grpc
        from envoy.config.core.v3 import base_pb2
        from envoy.service.ext_proc.v3 import external_processor_pb2 as ext
        from envoy.service.ext_proc.v3 import external_processor_pb2_grpc as ext_grpc
    except ImportError as exc:  # an `epp` without its client stubs is a broken setup, not a skip
        pytest.fail(f"the EPP test needs Envoy's ext_proc stubs: pip install xds-protos ({exc})")
    headers = [(":method", "POST"), (":path", "/v1/chat/completions"), (":authority", "sie"),
               ("content-type", "application/json")]
    raw = json.dumps(body).encode()
    messages = [
        ext.ProcessingRequest(request_headers=ext.HttpHeaders(headers=base_pb2.HeaderMap(headers=[
            base_pb2.HeaderValue(key=k, value=v, raw_value=v.encode()) for k, v in headers]))),
        ext.ProcessingRequest(request_body=ext.HttpBody(body=raw, end_of_stream=True)),
    ]
    with grpc.insecure_channel(f"127.0.0.1:{grpc_port}") as channel:
        call = ext_grpc.ExternalProcessorStub(channel).Process(iter(messages), timeout=30)
        try:
            for response in call:
                for phase in (response.request_headers, response.request_body):
                    for option in phase.response.header_mutation.set_headers:
                        if option.header.key == "x-gateway-destination-endpoint":
                            return option.header.raw_value.decode() or option.header.value
        finally:
            call.cancel()
    raise AssertionError("the EPP answered without x-gateway-destination-endpoint")


def test_the_endpoint_picker_routes_every_request_to_our_pod_not_the_saturated_one(pod: LocalStack, epp: int):
    body = {"model": MODEL, "max_tokens": 8, "messages": [{"role": "user", "content": "What is 2 + 2?"}]}
    picks = {_picked(epp, body) for _ in range(8)}
    assert picks == {f"127.0.0.1:{pod.gateway_port}"}
    answer = httpx.post(f"http://{picks.pop()}/v1/chat/completions", json=body, timeout=60)
    assert answer.status_code == 200 and answer.json()["choices"][0]["message"]["content"]
