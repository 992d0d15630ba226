"""Two API keys on the real stack (tritonserver, SmolLM2, the gunicorn gateway with a keys file): a stored response
is its key's alone, a cached prompt is its tenant's alone, a key rotated out is refused from its next request while
its open stream finishes, SIGHUP re-reads the keys file, and after all of it the key appears nowhere in the store,
the logs or the metrics."""

from __future__ import annotations

import os
import signal
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import openai
import pytest

from devstack.net import free_port, wait_http
from devstack.serve import start_gateway, stop
from devstack.stack import LocalStack, local_stack
from tests.helpers.prometheus import scrape
from tests.helpers.repository import smollm2_only
from tests.helpers.sse import DONE, data_payloads
from tests.helpers.waiting import wait_until

MODEL = "HuggingFaceTB/SmolLM2-135M-Instruct"
STUB_MODEL = "sie-test/stub-tokens"
# same length, so an in-place rewrite can keep the keys file's size (the SIGHUP test)
KEY_A = "planted-key-a-3c9e51f07d2b4a86"
KEY_B = "second-key-bb-8e4f0a17c6d35b92"
KEY_C = "rotated-key-cc-0d6b9e2a4f71c385"
KEY_D = "added-key-ddd-5a1c7f3e9b0d2468"
HISTORY = [{"role": "system", "content": "You answer in one short sentence about the sea. " * 8},
           {"role": "user", "content": "Name an ocean."}]


@dataclass
class TenantStack:
    running: LocalStack
    log_dir: Path
    keys: Path

    @property
    def url(self) -> str:
        return self.running.base_url

    def client(self, key: str) -> openai.OpenAI:
        return openai.OpenAI(base_url=self.url + "/v1", api_key=key, max_retries=0, timeout=120)

    def write_keys(self, *keys: str) -> None:
        """A new keys file renamed over the old one, as an operator (or a Secret volume) replaces it."""
        new = self.keys.with_name("keys.new")
        new.write_text("".join(f"{k}\n" for k in keys))
        os.replace(new, self.keys)


@pytest.fixture(scope="module")
def tenants(tmp_path_factory) -> Iterator[TenantStack]:
    log_dir = tmp_path_factory.mktemp("tenant-stack")
    secrets = tmp_path_factory.mktemp("tenant-secrets")  # the keys file holds the keys: outside what is scanned
    keys = secrets / "keys"
    keys.write_text(f"{KEY_A}\n{KEY_B}\n{KEY_C}\n")
    repo = smollm2_only(log_dir)
    metrics_dir = log_dir / "gateway-metrics"
    metrics_dir.mkdir()
    env = {"SIE_AUTH_MODE": "token", "SIE_AUTH_TOKENS_FILE": str(keys),
           "SIE_TENANT_SECRET_FILE": str(log_dir / "tenant.secret"),
           "SIE_RESPONSES_STORE": str(log_dir / "responses.sqlite3"),
           "GATEWAY_LOG_LEVEL": "DEBUG", "GATEWAY_ACCESS_LOG": "1", "PROMETHEUS_MULTIPROC_DIR": str(metrics_dir)}
    with local_stack(repo, log_dir, extra_env=env) as running:
        yield TenantStack(running, log_dir, keys)


def test_the_second_key_cannot_read_delete_or_continue_the_firsts_response(tenants):
    first = tenants.client(KEY_A).responses.create(model=MODEL, input="Name a colour.", max_output_tokens=4)
    other = tenants.client(KEY_B)
    with pytest.raises(openai.NotFoundError):
        other.responses.retrieve(first.id)
    with pytest.raises(openai.NotFoundError):
        other.responses.delete(first.id)
    with pytest.raises(openai.BadRequestError) as refused:
        other.responses.create(model=MODEL, input="And another?", previous_response_id=first.id, max_output_tokens=4)
    assert refused.value.body["param"] == "previous_response_id" and "was not found" in refused.value.body["message"]
    # still there for its owner, who can continue it
    assert tenants.client(KEY_A).responses.retrieve(first.id).id == first.id
    follow = tenants.client(KEY_A).responses.create(model=MODEL, input="And another?", previous_response_id=first.id,
                                                    max_output_tokens=4)
    assert follow.previous_response_id == first.id


def _cached(client: openai.OpenAI, question: str) -> int:
    reply = client.chat.completions.create(model=MODEL, messages=[*HISTORY, {"role": "user", "content": question}],
                                           max_tokens=1, temperature=0)
    assert reply.usage.prompt_tokens > 64
    return reply.usage.prompt_tokens_details.cached_tokens


def test_the_first_keys_cached_prompt_is_not_the_seconds(tenants):
    a, b = tenants.client(KEY_A), tenants.client(KEY_B)
    assert _cached(a, "Another?") == 0
    assert _cached(a, "A third?") >= 64  # the shared history: whole 16-token blocks
    assert _cached(b, "Another?") == 0  # the same prompt, cached for A: nothing of it for B
    assert _cached(a, "A fourth?") >= 64  # A still hits
    assert _cached(b, "A fifth?") >= 64  # B's own copy now serves B


def test_a_key_rotated_out_is_refused_next_while_its_open_stream_finishes(tenants):
    with httpx.Client(base_url=tenants.url, timeout=120) as http:
        body = {"model": MODEL, "messages": [{"role": "user", "content": "Count from one to twenty."}],
                "max_tokens": 24, "min_tokens": 24, "stream": True, "temperature": 0}
        with http.stream("POST", "/v1/chat/completions", json=body,
                         headers={"Authorization": f"Bearer {KEY_C}"}) as open_stream:
            assert open_stream.status_code == 200
            payloads = data_payloads(open_stream.iter_lines())
            first = next(payloads)
            tenants.write_keys(KEY_A, KEY_B)
            refused = http.get("/v1/models", headers={"Authorization": f"Bearer {KEY_C}"})
            assert refused.status_code == 401 and refused.json()["error"]["code"] == "UNAUTHORIZED"
            rest = [first, *payloads]
        assert rest[-1] == DONE and '"finish_reason":"length"' in rest[-2]
        assert http.get("/v1/models", headers={"x-api-key": KEY_A}).status_code == 200


def test_sighup_rereads_a_keys_file_rewritten_in_place(stub, tmp_path):
    """A rewrite that keeps the file's inode, size and mtime is invisible to the per-request check: SIGHUP to the
    gunicorn master makes its worker read it again, and replaces no worker. (A gateway of its own, with one worker,
    so that "no worker has seen it yet" is known; the stub model behind it declares no cache_salt input, so none is
    sent.)"""
    keys = tmp_path / "keys"
    keys.write_text(f"{KEY_A}\n{KEY_B}\n")
    port = free_port()
    gateway = start_gateway(stub.ports.grpc, port, workers=1, log_path=tmp_path / "gateway.log", extra_env={
        "SIE_AUTH_MODE": "token", "SIE_AUTH_TOKENS_FILE": str(keys), "SIE_RESPONSES_STORE": "off",
        "SIE_TENANT_SECRET_FILE": str(tmp_path / "tenant.secret")})
    try:
        url = f"http://127.0.0.1:{port}"
        wait_http(url + "/readyz")
        with httpx.Client(base_url=url, timeout=30) as http:
            chat = {"model": STUB_MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
            assert http.post("/v1/chat/completions", json=chat, headers={"x-api-key": KEY_B}).status_code == 200
            before = os.stat(keys)
            with open(keys, "r+") as same_file:
                same_file.write(f"{KEY_A}\n{KEY_D}\n")  # KEY_D in the place of KEY_B: the same length
            os.utime(keys, ns=(before.st_atime_ns, before.st_mtime_ns))
            assert os.stat(keys).st_size == before.st_size
            assert http.get("/v1/models", headers={"x-api-key": KEY_D}).status_code == 401  # not seen yet
            workers = _worker_pids(gateway.pid)
            os.kill(gateway.pid, signal.SIGHUP)
            # the master forwards the signal from its loop, within about a second
            wait_until(lambda: http.get("/v1/models", headers={"x-api-key": KEY_D}).status_code == 200, 30,
                       "the worker never re-read the keys file", interval_s=0.2)
            assert http.get("/v1/models", headers={"x-api-key": KEY_B}).status_code == 401
            assert http.post("/v1/chat/completions", json=chat, headers={"x-api-key": KEY_D}).status_code == 200
            assert _worker_pids(gateway.pid) == workers  # re-read in place: no worker replaced
    finally:
        stop(gateway)


def _worker_pids(master: int) -> set[int]:
    children = Path(f"/proc/{master}/task/{master}/children").read_text().split()
    return {int(pid) for pid in children}


def test_the_planted_key_appears_nowhere_in_the_store_logs_or_metrics(tenants):
    """Runs last: every request above used KEY_A or its peers; a few more here touch the error paths, then every
    file the stack wrote (the store and its WAL, both logs, the gateway's metrics files) and both metrics pages are
    searched for the key."""
    with httpx.Client(base_url=tenants.url, timeout=120) as http:
        auth = {"Authorization": f"Bearer {KEY_A}"}
        assert http.post("/v1/chat/completions", json={"model": MODEL}, headers=auth).status_code == 400
        assert http.post("/v1/chat/completions", headers=auth, json={
            "model": "nope/nothing", "messages": [{"role": "user", "content": "hi"}]}).status_code == 404
        assert http.post("/v1/responses", headers={"x-api-key": KEY_A}, json={
            "model": MODEL, "input": "Say hi.", "max_output_tokens": 3, "stream": True}).status_code == 200
        assert http.post("/tokenize", json={"model": MODEL, "prompt": "hi"}, headers=auth).status_code == 200
        assert http.get("/v1/responses/resp_missing", headers=auth).status_code == 404
        assert http.post("/v1/chat/completions", headers={"Authorization": f"Bearer {KEY_A}x"}, json={
            "model": MODEL, "messages": [{"role": "user", "content": "hi"}]}).status_code == 401
        gateway_metrics = http.get("/metrics", headers=auth).text
    triton_metrics = scrape(f"http://127.0.0.1:{tenants.running.triton_ports.metrics}/metrics")
    assert "sie_gateway_requests_total" in gateway_metrics and "nv_inference" in triton_metrics
    written = [p for p in tenants.log_dir.rglob("*") if p.is_file() and not p.is_symlink()]
    names = {p.name for p in written}
    assert {"responses.sqlite3", "gateway.log", "triton.log"} <= names
    assert any(name.endswith(".db") for name in names)  # the gateway's metrics files
    assert b'"route":"chat"' in (tenants.log_dir / "gateway.log").read_bytes()  # the request log is there
    assert KEY_A.encode() in tenants.keys.read_bytes()  # the search finds the key where it is meant to be
    for key in (KEY_A, KEY_B, KEY_C):
        leaks = [str(p.relative_to(tenants.log_dir)) for p in written if key.encode() in p.read_bytes()]
        assert not leaks, f"a key was written to {leaks}"
        assert key not in gateway_metrics and key not in triton_metrics
