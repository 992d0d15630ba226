"""Drive the real `sie-sdk` 0.10.1 client against a gateway; prints one JSON document on stdout.

Runs under the SDK's own Python >= 3.12 venv (`.venv-sdk`), not the project venv, so it imports
nothing from this repository:

    .venv-sdk/bin/python tests/e2e/sdk_driver.py <scenario> <base_url> [model]

Every scenario prints `{"ok": true, ...}` with what the SDK returned, or, when the SDK raised,
`{"ok": false, "error": {class, code, status_code, param, message}}`.
"""

from __future__ import annotations

import http.server
import json
import sys
import threading
import urllib.error
import urllib.request
from typing import Any

from sie_sdk import SIEClient, SIEError

PROMPT = "The capital of France is"
MESSAGES = [{"role": "user", "content": "What is the capital of France? Answer in one word."}]


def _error(exc: BaseException) -> dict[str, Any]:
    return {
        "class": type(exc).__name__,
        "mro": [c.__name__ for c in type(exc).__mro__],
        "code": getattr(exc, "code", None),
        "status_code": getattr(exc, "status_code", None),
        "param": getattr(exc, "param", None),
        "retry_after": getattr(exc, "retry_after", None),
        "message": str(exc),
    }


def generate(client: SIEClient, model: str) -> dict[str, Any]:
    result = client.generate(model, PROMPT, max_new_tokens=8, temperature=0)
    return {"result": dict(result), "retries": client.last_retry_count, "revision": client.last_model_revision}


def stream_generate(client: SIEClient, model: str) -> dict[str, Any]:
    chunks = list(client.stream_generate(model, PROMPT, max_new_tokens=6, temperature=0,
                                         logprobs=True, top_logprobs=2))
    return {"chunks": [dict(c) for c in chunks], "retries": client.last_retry_count}


def chat_completions(client: SIEClient, model: str) -> dict[str, Any]:
    result = client.chat_completions(model, MESSAGES, max_completion_tokens=8, temperature=0)
    return {"result": dict(result), "retries": client.last_retry_count}


def stream_chat_completions(client: SIEClient, model: str) -> dict[str, Any]:
    chunks = list(client.stream_chat_completions(model, MESSAGES, max_completion_tokens=8, temperature=0,
                                                 stream_options={"include_usage": True}))
    return {"chunks": [dict(c) for c in chunks], "retries": client.last_retry_count}


def error_temperature(client: SIEClient, model: str) -> dict[str, Any]:
    return {"result": dict(client.generate(model, PROMPT, max_new_tokens=4, temperature=-1))}


def error_temperature_chat(client: SIEClient, model: str) -> dict[str, Any]:
    return {"result": dict(client.chat_completions(model, MESSAGES, max_completion_tokens=4, temperature=-1))}


def error_temperature_stream(client: SIEClient, model: str) -> dict[str, Any]:
    return {"chunks": list(client.stream_generate(model, PROMPT, max_new_tokens=4, temperature=-1))}


def error_unknown_model(client: SIEClient, model: str) -> dict[str, Any]:
    return {"result": dict(client.generate("no-such-org/no-such-model", PROMPT, max_new_tokens=4))}


def error_unknown_model_chat(client: SIEClient, model: str) -> dict[str, Any]:
    return {"result": dict(client.chat_completions("no-such-org/no-such-model", MESSAGES, max_completion_tokens=4))}


def error_context_exceeded(client: SIEClient, model: str) -> dict[str, Any]:
    return {"result": dict(client.generate(model, PROMPT, max_new_tokens=10**6))}


def provisioning_no_wait(client: SIEClient, model: str) -> dict[str, Any]:
    return {"result": dict(client.generate(model, PROMPT, max_new_tokens=4, wait_for_capacity=False))}


def wait_for_capacity(client: SIEClient, model: str) -> dict[str, Any]:
    """Retries 503 PROVISIONING (honouring Retry-After) until a Triton comes up behind the gateway."""
    result = client.generate(model, PROMPT, max_new_tokens=4, wait_for_capacity=True, provision_timeout_s=240)
    return {"result": dict(result), "retries": client.last_retry_count}


# -- 503 MODEL_LOADING once, then the real gateway ------------------------------------------------


class _LoadingOnceProxy(http.server.ThreadingHTTPServer):
    """Answers the first POST with 503 MODEL_LOADING (Retry-After: 1); relays later ones upstream."""

    daemon_threads = True

    def __init__(self, upstream: str) -> None:
        super().__init__(("127.0.0.1", 0), _ProxyHandler)
        self.upstream = upstream.rstrip("/")
        self.lock = threading.Lock()
        self.armed = True
        self.seen: list[dict[str, Any]] = []

    def arm(self) -> None:
        with self.lock:
            self.armed = True


class _ProxyHandler(http.server.BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    server: _LoadingOnceProxy

    def log_message(self, *args: Any) -> None:  # keep stdout pure JSON
        pass

    def do_POST(self) -> None:
        body = self.rfile.read(int(self.headers.get("content-length") or 0))
        with self.server.lock:
            refuse, self.server.armed = self.server.armed, False
        if refuse:
            payload = json.dumps({"error": {"message": "model is loading", "type": "server_error", "param": None,
                                            "code": "MODEL_LOADING"}}).encode()
            self.server.seen.append({"path": self.path, "status": 503})
            self._reply(503, {"Content-Type": "application/json", "X-SIE-Error-Code": "MODEL_LOADING",
                              "Retry-After": "1"}, payload)
            return
        headers = {k: v for k, v in self.headers.items()
                   if k.lower() not in {"host", "content-length", "connection", "accept-encoding"}}
        request = urllib.request.Request(self.server.upstream + self.path, data=body, headers=headers, method="POST")
        try:
            with urllib.request.urlopen(request, timeout=120) as upstream:
                status, reply_headers, data = upstream.status, upstream.headers, upstream.read()
        except urllib.error.HTTPError as exc:
            status, reply_headers, data = exc.code, exc.headers, exc.read()
        self.server.seen.append({"path": self.path, "status": status})
        passed = {k: v for k, v in reply_headers.items()
                  if k.lower() not in {"content-length", "transfer-encoding", "connection", "date", "server"}}
        self._reply(status, passed, data)

    def _reply(self, status: int, headers: dict[str, str], data: bytes) -> None:
        self.send_response(status)
        for name, value in headers.items():
            self.send_header(name, value)
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)


def retry_model_loading(base_url: str, model: str) -> dict[str, Any]:
    proxy = _LoadingOnceProxy(base_url)
    thread = threading.Thread(target=proxy.serve_forever, daemon=True)
    thread.start()
    out: dict[str, Any] = {}
    try:
        for name, call in (("generate", generate), ("stream_generate", stream_generate),
                           ("chat_completions", chat_completions)):
            proxy.arm()
            proxy.seen.clear()
            client = SIEClient(f"http://127.0.0.1:{proxy.server_address[1]}", timeout_s=120)
            try:
                out[name] = {"ok": True, **call(client, model), "seen": list(proxy.seen)}
            except SIEError as exc:
                out[name] = {"ok": False, "error": _error(exc), "seen": list(proxy.seen)}
            finally:
                client.close()
    finally:
        proxy.shutdown()
        proxy.server_close()
    return out


def watch(client: SIEClient, model: str) -> dict[str, Any]:
    """The first two messages of `client.watch()` (auto mode: it asks /health whether this is a gateway)."""
    messages = []
    for message in client.watch():
        messages.append(message)
        if len(messages) == 2:
            break
    return {"messages": messages}


def capacity(client: SIEClient, model: str) -> dict[str, Any]:
    return {"all": dict(client.get_capacity()), "default": dict(client.get_capacity(gpu="default")),
            "l4": dict(client.get_capacity(gpu="l4"))}


def models(client: SIEClient, model: str) -> dict[str, Any]:
    return {"listed": [dict(m) for m in client.list_models()], "model": dict(client.get_model(model))}


def responses(client: SIEClient, model: str) -> dict[str, Any]:
    result = client.responses(model, "What is the capital of France? Answer in one word.", max_output_tokens=8,
                              temperature=0)
    return {"result": dict(result)}


SCENARIOS = {f.__name__: f for f in (
    generate, stream_generate, chat_completions, stream_chat_completions, error_temperature,
    error_temperature_chat, error_temperature_stream, error_unknown_model, error_unknown_model_chat,
    error_context_exceeded, provisioning_no_wait, wait_for_capacity, watch, capacity, models, responses,
)}


def main() -> None:
    scenario, base_url = sys.argv[1], sys.argv[2]
    model = sys.argv[3] if len(sys.argv) > 3 else "HuggingFaceTB/SmolLM2-135M-Instruct"
    if scenario == "retry_model_loading":
        print(json.dumps({"ok": True, **retry_model_loading(base_url, model)}))
        return
    client = SIEClient(base_url, timeout_s=120)
    try:
        out = {"ok": True, **SCENARIOS[scenario](client, model)}
    except SIEError as exc:
        out = {"ok": False, "error": _error(exc)}
    finally:
        client.close()
    print(json.dumps(out, default=str))


if __name__ == "__main__":
    main()
