"""Faults against real processes: tritonserver killed and restarted, slow readers, a malformed model,
client disconnects cancelling the engine, and logs that never carry prompts or secrets."""

from __future__ import annotations

import json
import socket
import threading
import time

import httpx

from tests.e2e.conftest import MODEL, STUB, TOKEN, StubStack
from tests.helpers.sse import data_payloads
from tests.helpers.waiting import poll

SECRET_PROMPT = "zebra-violet-secret-prompt-4711"
SECRET_USER = "user-secret-8832"
SECRET_SAFETY = "safety-secret-1199"


def _generate(stub: StubStack, tokens: int, stream: bool, **extra) -> httpx.Response:
    return httpx.post(f"{stub.url}/v1/generate/{STUB}", headers=stub.headers, timeout=60,
                      json={"prompt": "hi", "max_new_tokens": tokens, "stream": stream, **extra})


def test_malformed_model_output_is_a_500_and_the_gateway_stays_healthy(stub):
    r = httpx.post(f"{stub.url}/v1/generate/sie-test__malformed-output", headers=stub.headers,
                   json={"prompt": "hi", "max_new_tokens": 3}, timeout=30)
    assert r.status_code == 500
    assert r.json()["error"]["code"] == "malformed_worker_response"
    assert _generate(stub, 3, False).status_code == 200


def test_slow_reader_does_not_stall_other_streams(stub):
    body = json.dumps({"prompt": "hi", "max_new_tokens": 50000, "stream": True}).encode()
    slow = socket.create_connection(("127.0.0.1", stub.port))
    slow.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    slow.sendall(b"POST /v1/generate/" + STUB.encode() + b" HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                 b"Authorization: Bearer " + TOKEN.encode() + b"\r\nContent-Length: " + str(len(body)).encode()
                 + b"\r\n\r\n" + body)
    stop_reading = threading.Event()

    def read_slowly() -> None:
        while not stop_reading.is_set() and slow.recv(1):
            time.sleep(0.05)

    reader = threading.Thread(target=read_slowly, daemon=True)
    reader.start()
    time.sleep(1.0)  # the slow stream is open and backed up
    started = time.monotonic()
    results = []

    def fast() -> None:
        r = _generate(stub, 500, True)
        results.append(r.status_code == 200 and r.text.rstrip().endswith("data: [DONE]"))

    threads = [threading.Thread(target=fast) for _ in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=30)
    elapsed = time.monotonic() - started
    stop_reading.set()
    reader.join(timeout=5)
    slow.close()
    assert results == [True, True, True]
    assert elapsed < 20


def test_tritonserver_killed_mid_stream_then_back(stub):
    events = []
    errors = []
    with httpx.stream("POST", f"{stub.url}/v1/generate/{STUB}", headers=stub.headers, timeout=60,
                      json={"prompt": "hi", "max_new_tokens": 90000, "stream": True}) as r:
        assert r.status_code == 200
        for payload in data_payloads(r.iter_lines()):
            events.append(payload)
            if len(events) == 50:
                stub.kill_triton()
            if payload != "[DONE]" and json.loads(payload).get("error"):
                errors.append(json.loads(payload))
    assert events[-1] == "[DONE]"
    assert len(errors) == 1 and errors[0]["finish_reason"] == "error" and errors[0]["done"] is True
    blocking = _generate(stub, 3, False)
    assert blocking.status_code == 503 and "Retry-After" in blocking.headers
    assert httpx.get(stub.url + "/readyz", timeout=10).status_code == 503
    stub.start_triton()
    poll(lambda: _generate(stub, 3, False).status_code == 200, 30, interval_s=0.5)
    assert _generate(stub, 3, False).status_code == 200
    assert httpx.get(stub.url + "/readyz", timeout=10).status_code == 200


def _request_lines(text: str) -> dict[str, dict]:
    """The gateway's JSON access lines ("msg": "request"), by request id."""
    lines = {}
    for raw in text.splitlines():
        try:
            entry = json.loads(raw)
        except ValueError:
            continue
        if isinstance(entry, dict) and entry.get("msg") == "request":
            lines[entry.get("request_id")] = entry
    return lines


def test_logs_never_carry_prompts_or_secrets(stub):
    responses = [
        httpx.post(f"{stub.url}/v1/chat/completions", headers=stub.headers, timeout=30, json={
            "model": "sie-test/stub-tokens", "max_tokens": 2, "user": SECRET_USER, "safety_identifier": SECRET_SAFETY,
            "messages": [{"role": "user", "content": SECRET_PROMPT}]}),
        httpx.post(f"{stub.url}/v1/chat/completions", headers={"Authorization": "Bearer wrong-" + TOKEN}, timeout=30,
                   json={"model": "x", "messages": [{"role": "user", "content": SECRET_PROMPT}]}),
        _generate(stub, 2, False, prompt=SECRET_PROMPT, safety_identifier=SECRET_SAFETY),
    ]
    assert [r.status_code for r in responses] == [200, 401, 200]
    # first prove the log is written, per request, and with which fields: absences prove nothing otherwise
    ids = [r.headers["X-SIE-Request-ID"] for r in responses]
    logged = poll(lambda: _request_lines((stub.logs / "gateway.log").read_text(errors="replace")), 5,
                  until=lambda logged: all(i in logged for i in ids))
    for response, request_id, route in zip(responses, ids, ("chat", "chat", "generate"), strict=True):
        entry = logged.get(request_id)
        assert entry is not None, f"no request line for {request_id}"
        assert set(entry) == {"ts", "level", "logger", "msg", "request_id", "route", "status", "model", "ms"}
        assert (entry["route"], entry["status"]) == (route, response.status_code)
    for name in ("gateway.log", "triton.log"):
        text = (stub.logs / name).read_text(errors="replace")
        assert text.strip(), f"{name} is empty"
        for secret in (SECRET_PROMPT, SECRET_USER, SECRET_SAFETY, TOKEN):
            assert secret not in text, f"{secret} leaked into {name}"


def test_the_access_log_never_carries_a_query_string(stub):
    """GATEWAY_ACCESS_LOG=1 (the stub stack's gateway runs with it): request lines, without `?...`."""
    marker = "access-log-probe-4410"
    for path in (f"/readyz?api_key={TOKEN}&{marker}=1", f"/v1/models?api_key={TOKEN}&{marker}=2"):
        httpx.get(stub.url + path, timeout=10)
    text = poll(lambda: (stub.logs / "gateway.log").read_text(errors="replace"), 5,
                until=lambda text: '"GET /v1/models HTTP/1.1" 401' in text)
    assert '"GET /readyz HTTP/1.1" 200' in text  # the access log is on, and logs the path
    assert '"GET /v1/models HTTP/1.1" 401' in text
    assert marker not in text and TOKEN not in text


def test_client_disconnect_cancels_the_engine_request(stack):
    before = stack.triton_metric("sie_engine_request_cancelled_total")
    with httpx.stream("POST", f"{stack.base_url}/v1/chat/completions", timeout=60, json={
            "model": MODEL, "max_tokens": 1500, "stream": True, "temperature": 0.7,
            "messages": [{"role": "user", "content": "Tell me a very long story."}]}) as r:
        for i, _ in enumerate(r.iter_lines()):
            if i > 5:
                break  # leave mid-stream: closing the response drops the connection
    deadline = time.monotonic() + 15  # for both waits together
    poll(lambda: stack.triton_metric("sie_engine_request_cancelled_total"), 15, until=lambda n: n > before,
         interval_s=0.25)
    assert stack.triton_metric("sie_engine_request_cancelled_total") == before + 1
    poll(lambda: stack.triton_metric("sie_engine_num_requests_running"), deadline - time.monotonic(),
         until=lambda n: n == 0, interval_s=0.25)
    assert stack.triton_metric("sie_engine_num_requests_running") == 0
