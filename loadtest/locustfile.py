"""Locust load test for the gateway: both contracts, streaming and blocking.

User classes (pick a subset by naming them after ``-f``, e.g. ``ChatStreamUser GenerateStreamUser``):

- ``ChatStreamUser``      POST /v1/chat/completions, ``stream: true``  -> rows "chat stream", "chat TTFT"
- ``ChatBlockingUser``    POST /v1/chat/completions                   -> row  "chat"
- ``GenerateStreamUser``  POST /v1/generate/{sie_id}, ``stream: true`` -> rows "generate stream", "generate TTFT"
- ``GenerateBlockingUser`` POST /v1/generate/{sie_id}                  -> row  "generate"

Accounting:

- Streaming rows record the total time (request sent to ``data: [DONE]``); TTFT (request sent to the
  first event carrying generated text) is a separate row of request type ``TTFT``.
- Deliberate back-pressure (503 with ``X-SIE-Error-Code: QUEUE_FULL``) is reported under the row
  "backpressure 503" as a success, not under the route's own row, so that failures count only real
  errors and the route's latency percentiles are those of served requests. The user then honours
  ``Retry-After`` (capped) before its next request, as the SDK does.
- Failures: any other non-200, a 200 body of the wrong shape, a stream that is not SSE, a stream
  that ends without ``data: [DONE]``, an in-band ``error`` event, or a transport error.

Environment: ``SIE_LOADTEST_MODEL`` (default ``HuggingFaceTB/SmolLM2-135M-Instruct``),
``SIE_LOADTEST_TOKEN`` (sent as ``Authorization: Bearer``), ``SIE_LOADTEST_TIMEOUT`` (read timeout,
seconds, default 300), ``SIE_LOADTEST_SUMMARY`` (path: at test stop, write the merged counts and TTFT /
total percentiles there as JSON; ``loadtest/run.py`` sets it).
"""

from __future__ import annotations

import json
import os
import random
import time
from typing import Any, cast

from locust import HttpUser, between, events, task
from locust.clients import ResponseContextManager
from locust.env import Environment
from locust.stats import StatsEntry

MODEL = os.environ.get("SIE_LOADTEST_MODEL", "HuggingFaceTB/SmolLM2-135M-Instruct")
SIE_ID = MODEL.replace("/", "__")
TOKEN = os.environ.get("SIE_LOADTEST_TOKEN", "")
READ_TIMEOUT_S = float(os.environ.get("SIE_LOADTEST_TIMEOUT", "300"))
CONNECT_TIMEOUT_S = 10.0
MAX_RETRY_AFTER_S = 5.0

TTFT_TYPE = "TTFT"
BACKPRESSURE_NAME = "backpressure 503"
BACKPRESSURE_CODE = "QUEUE_FULL"

# Varied questions of roughly 20-60 prompt tokens once templated.
QUESTIONS: tuple[str, ...] = (
    "What is the capital of France, and why did it become the political centre of the country?",
    "Explain in two sentences how photosynthesis turns sunlight into chemical energy in plants.",
    "Write a short haiku about autumn leaves falling into a quiet mountain river at dawn.",
    "I have three apples and buy five more, then give two to a friend. How many apples do I have left?",
    "List three practical tips for staying focused while working from home on a busy day.",
    "What is the difference between a list and a tuple in Python? Give a one-line example of each.",
    "Summarise the plot of Romeo and Juliet in a few sentences for a ten-year-old reader.",
    "Why is the sky blue during the day but often red or orange at sunset? Keep it brief.",
    "Suggest a name for a small bakery that specialises in sourdough bread and cinnamon rolls.",
    "Translate 'Good morning, how are you today?' into Spanish and French.",
    "What are the main causes of ocean tides, and how often do high tides occur each day?",
    "Give me a simple recipe for a healthy breakfast that takes less than ten minutes to prepare.",
    "Describe how a bicycle stays upright while moving, in plain language without equations.",
    "What should I pack for a three-day hiking trip in the mountains in early spring?",
)
SYSTEM_PROMPT = "You are a helpful, concise assistant."


def _max_tokens() -> int:
    return random.randint(32, 96)


def _sampling() -> dict[str, Any]:
    # Mix greedy and sampled decoding, as real traffic does.
    if random.random() < 0.5:
        return {"temperature": 0.0}
    return {"temperature": 0.7, "top_p": 0.9}


def chat_body(stream: bool) -> dict[str, Any]:
    """A chat completions request with a random question, sometimes behind a system message."""
    messages: list[dict[str, Any]] = []
    if random.random() < 0.5:
        messages.append({"role": "system", "content": SYSTEM_PROMPT})
    messages.append({"role": "user", "content": random.choice(QUESTIONS)})
    body: dict[str, Any] = {"model": MODEL, "messages": messages, "max_tokens": _max_tokens(), **_sampling()}
    if stream:
        body["stream"] = True
    return body


def generate_body(stream: bool) -> dict[str, Any]:
    """A native generate request: a raw-continuation prompt (no chat template on this route)."""
    prompt = f"Question: {random.choice(QUESTIONS)}\nAnswer:"
    body: dict[str, Any] = {"prompt": prompt, "max_new_tokens": _max_tokens(), **_sampling()}
    if stream:
        body["stream"] = True
    return body


def _headers(stream: bool) -> dict[str, str]:
    headers = {
        "Content-Type": "application/json",
        "Accept": "text/event-stream" if stream else "application/json",
    }
    if TOKEN:
        headers["Authorization"] = f"Bearer {TOKEN}"
    return headers


def _meta(resp: ResponseContextManager) -> dict[str, Any]:
    """The request's pending stats record (a dict at run time; typed as a read-only Mapping)."""
    return cast(dict[str, Any], resp.request_meta)


def _is_backpressure(resp: ResponseContextManager) -> bool:
    return resp.status_code == 503 and resp.headers.get("X-SIE-Error-Code") == BACKPRESSURE_CODE


def _retry_after_s(resp: ResponseContextManager) -> float:
    try:
        value = float(resp.headers.get("Retry-After", "1"))
    except ValueError:
        value = 1.0
    return min(max(value, 0.0), MAX_RETRY_AFTER_S)


def _error_summary(resp: ResponseContextManager) -> str:
    """`HTTP 500 malformed_worker_response`, for grouping failures by status and code."""
    if not resp.status_code:  # locust's stand-in response for a transport error
        return f"transport error: {type(getattr(resp, 'error', None)).__name__}"
    code = resp.headers.get("X-SIE-Error-Code")
    if code is None:
        try:
            error = resp.json().get("error")
            code = error.get("code") if isinstance(error, dict) else None
        except (ValueError, AttributeError):
            code = None
    return f"HTTP {resp.status_code} {code or ''}".rstrip()


def _chat_text(event: dict[str, Any]) -> str:
    choices = event.get("choices") or []
    if not choices or not isinstance(choices[0], dict):
        return ""
    delta = choices[0].get("delta") or {}
    text = delta.get("content") or ""
    if not text and delta.get("tool_calls"):
        text = "tool_calls"
    return text


def _generate_text(event: dict[str, Any]) -> str:
    return event.get("text_delta") or ""


def _valid_chat(body: Any) -> bool:
    if not isinstance(body, dict) or not isinstance(body.get("usage"), dict):
        return False
    choices = body.get("choices")
    if not isinstance(choices, list) or not choices or not isinstance(choices[0], dict):
        return False
    message = choices[0].get("message")
    if not isinstance(message, dict):
        return False
    return isinstance(message.get("content"), str) or bool(message.get("tool_calls"))


def _valid_generate(body: Any) -> bool:
    return isinstance(body, dict) and isinstance(body.get("model"), str) and isinstance(body.get("text"), str)


class _GatewayUser(HttpUser):
    """Shared request plumbing; subclasses pick a route and a body."""

    abstract = True
    wait_time = between(0.2, 1.0)
    _pause_s: float = 0.0  # back-off owed after a QUEUE_FULL answer

    def _post(self, path: str, name: str, body: dict[str, Any], stream: bool) -> ResponseContextManager:
        return self.client.post(
            path,
            json=body,
            headers=_headers(stream),
            name=name,
            stream=stream,
            catch_response=True,
            timeout=(CONNECT_TIMEOUT_S, READ_TIMEOUT_S),
        )

    def _backpressure(self, resp: ResponseContextManager) -> None:
        """Move a deliberate 503 QUEUE_FULL to its own row, as a success, then back off."""
        _meta(resp)["name"] = BACKPRESSURE_NAME
        resp.success()
        self._pause_s = _retry_after_s(resp)

    def _after(self) -> None:
        pause, self._pause_s = self._pause_s, 0.0
        if pause:
            time.sleep(pause)  # gevent-patched: yields to other users

    def blocking(self, path: str, name: str, body: dict[str, Any], valid: Any) -> None:
        with self._post(path, name, body, stream=False) as resp:
            if _is_backpressure(resp):
                self._backpressure(resp)
            elif resp.status_code != 200:
                resp.failure(_error_summary(resp))
            else:
                try:
                    parsed = resp.json()
                except ValueError:
                    parsed = None
                if valid(parsed):
                    resp.success()
                else:
                    resp.failure("200 with a malformed body")
        self._after()

    def streaming(self, path: str, name: str, body: dict[str, Any], text_of: Any) -> None:
        """Read an SSE stream; record TTFT at the first text-bearing event, total time at [DONE]."""
        start = time.perf_counter()
        with self._post(path, name, body, stream=True) as resp:
            try:
                self._read_stream(resp, name, start, text_of)
            finally:
                resp.close()
        self._after()

    def _read_stream(self, resp: ResponseContextManager, name: str, start: float, text_of: Any) -> None:
        if _is_backpressure(resp):
            self._backpressure(resp)
            return
        if resp.status_code != 200:
            resp.failure(_error_summary(resp))
            return
        if not resp.headers.get("Content-Type", "").startswith("text/event-stream"):
            resp.failure("stream requested, answer is not text/event-stream")
            return
        ttft_ms: float | None = None
        done = False
        error: str | None = None
        length = 0
        try:
            # chunk_size=None: yield each chunk as the server flushes it, so TTFT is not delayed by
            # buffering (requests documents None for stream=True; its type stubs say int).
            for raw in resp.iter_lines(chunk_size=None):  # type: ignore[call-overload]
                length += len(raw) + 1
                if not raw or raw.startswith(b":"):
                    continue  # event separator or keep-alive comment
                if not raw.startswith(b"data:"):
                    continue  # other SSE fields are ignored, as the SDK does
                payload = raw[5:].strip()
                if payload == b"[DONE]":
                    done = True
                    break
                try:
                    event = json.loads(payload)
                except ValueError:
                    error = "malformed SSE chunk"
                    break
                if not isinstance(event, dict):
                    error = "malformed SSE chunk"
                    break
                if isinstance(event.get("error"), dict):
                    error = f"in-band error {event['error'].get('code')}"
                    # Keep reading: the stream must still end with [DONE]; the failure stands either way.
                    continue
                if ttft_ms is None and text_of(event):
                    ttft_ms = (time.perf_counter() - start) * 1000
                    self.environment.events.request.fire(
                        request_type=TTFT_TYPE,
                        name=f"{name.split()[0]} TTFT",
                        response_time=ttft_ms,
                        response_length=0,
                        exception=None,
                        context={},
                    )
        except Exception as exc:
            error = f"stream broken: {type(exc).__name__}"
        meta = _meta(resp)
        meta["response_time"] = (time.perf_counter() - start) * 1000
        meta["response_length"] = length
        if error is not None:
            resp.failure(error)
        elif not done:
            resp.failure("stream ended without data: [DONE]")
        else:
            resp.success()


class ChatStreamUser(_GatewayUser):
    @task
    def chat_stream(self) -> None:
        self.streaming("/v1/chat/completions", "chat stream", chat_body(stream=True), _chat_text)


class ChatBlockingUser(_GatewayUser):
    @task
    def chat(self) -> None:
        self.blocking("/v1/chat/completions", "chat", chat_body(stream=False), _valid_chat)


class GenerateStreamUser(_GatewayUser):
    @task
    def generate_stream(self) -> None:
        self.streaming(f"/v1/generate/{SIE_ID}", "generate stream", generate_body(stream=True), _generate_text)


class GenerateBlockingUser(_GatewayUser):
    @task
    def generate(self) -> None:
        self.blocking(f"/v1/generate/{SIE_ID}", "generate", generate_body(stream=False), _valid_generate)


def _merged(environment: Environment, label: str, rows: list[StatsEntry]) -> dict[str, Any]:
    total = StatsEntry(environment.stats, label, "", use_response_times_cache=False)
    for row in rows:
        total.extend(row)
    if total.num_requests == 0:
        return {"count": 0, "failures": 0, "p50_ms": None, "p99_ms": None, "req_per_s": 0.0}
    return {
        "count": total.num_requests,
        "failures": total.num_failures,
        "p50_ms": total.get_response_time_percentile(0.5),
        "p99_ms": total.get_response_time_percentile(0.99),
        "req_per_s": total.total_rps,
    }


@events.test_stop.add_listener
def write_summary(environment: Environment, **_: Any) -> None:
    """Merged figures at test stop, once every in-flight request has been counted.

    The stats CSV is rewritten only once a second, so its last version can miss the requests that
    finished during shutdown; and percentiles of several rows cannot be merged from it at all.
    """
    path = os.environ.get("SIE_LOADTEST_SUMMARY")
    if not path or environment.stats is None:
        return
    rows = list(environment.stats.entries.values())
    ttft = [r for r in rows if r.method == TTFT_TYPE]
    served = [r for r in rows if r.method != TTFT_TYPE and r.name != BACKPRESSURE_NAME]
    summary = {
        "served": _merged(environment, "served", served),
        "backpressure": _merged(environment, BACKPRESSURE_NAME, [r for r in rows if r.name == BACKPRESSURE_NAME]),
        "ttft": _merged(environment, "TTFT", ttft),
        "stream_total": _merged(environment, "stream total", [r for r in served if r.name.endswith(" stream")]),
        "failures": environment.stats.total.num_failures,
    }
    with open(path, "w", encoding="utf-8") as fh:
        json.dump(summary, fh, indent=2)
