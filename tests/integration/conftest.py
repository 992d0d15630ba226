"""The real gateway app against a scripted fake Triton backend (same interface as `TritonClient`).

A test builds a gateway with `await make_gateway(...)`, steers each fake endpoint through
`gw.fake(url).script` (what `generate` yields / raises / waits for) and reads what the fake saw
in `gw.fake(url).calls` (requests, and whether the upstream generator was closed or cancelled).
"""

from __future__ import annotations

import asyncio
import itertools
import json
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Any

import httpx
import pytest

from gateway.app import create_app
from gateway.disconnect import DisconnectAware
from gateway.domain import GenerationEvent, GenerationRequest, TokenizerResult, TokenizerTask
from gateway.registry import ModelRegistry
from gateway.settings import EndpointConfig, PoolConfig, Settings
from gateway.supervisor import ModelSupervisor
from gateway.triton.client import UpstreamUnavailable

MODEL = "acme/Tiny-1.5B-Instruct"  # canonical id: a slash and dots, as real ids have
SIE_MODEL = "acme__Tiny-1.5B-Instruct"
TRITON_MODEL = "tiny"
MAX_OUTPUT = 2048

BASE_PARAMS: dict[str, str] = {
    "served_name": MODEL,
    "max_output_tokens": str(MAX_OUTPUT),
    "lora_paths": json.dumps({"sql": "/adapters/sql"}),
    "grammar_kinds": "json_schema,regex",
}


class Hang:
    """Script step: wait forever (a model that never produces the next token)."""


HANG = Hang()


@dataclass
class Delay:
    """Script step: wait this many seconds before the next step."""

    seconds: float


def ev(text: str = "", index: int = 0, finish: str | None = None, prompt: int = 0, completion: int = 0,
       **kw: Any) -> GenerationEvent:
    return GenerationEvent(index=index, text=text, finish_reason=finish, prompt_tokens=prompt,
                           completion_tokens=completion, **kw)


def tokens(*texts: str, finish: str = "stop", prompt: int = 5, index: int = 0) -> list[GenerationEvent]:
    """One event per text; the last one closes the choice with usage (completion = number of texts)."""
    events = [ev(t, index=index, prompt=prompt) for t in texts[:-1]]
    events.append(ev(texts[-1], index=index, finish=finish, prompt=prompt, completion=len(texts)))
    return events


@dataclass
class Call:
    """One `generate` call the gateway made on a fake endpoint."""

    triton_model: str
    req: GenerationRequest
    request_id: str
    sent: int = 0
    completed: bool = False  # the script ran to its end
    cancelled: bool = False  # the gateway cancelled/closed it while it was still producing
    closed: bool = False  # the generator's `finally` ran (always, once the gateway is done with it)
    first_sent: asyncio.Event = field(default_factory=asyncio.Event)
    order: int = field(default_factory=itertools.count().__next__)  # global call order


Script = list[Any] | Callable[[GenerationRequest], list[Any]]


class FakeTriton:
    """Implements TritonClient's interface: generate / list_models / close."""

    def __init__(self, url: str, models: list[tuple[str, str, dict[str, str]]] | None = None) -> None:
        self.url = url
        self.models = models if models is not None else [(TRITON_MODEL, "READY", dict(BASE_PARAMS))]
        self.script: Script = tokens("Hello", " world")
        self.down = False  # list_models fails like an unreachable Triton
        self.listed = 0  # list_models calls
        self.dead: set[str] = set()  # Triton models whose process is dead (probe answers False)
        self.inputs = frozenset({"text_input", "messages", "sampling_parameters", "stream", "cache_salt", "tenant"})
        self.reloads: list[str] = []
        self.calls: list[Call] = []
        self.tokenizer_calls: list[TokenizerTask] = []
        self.closed = False

    async def list_models(self, timeout: float = 5.0) -> list[tuple[str, str, dict[str, str], frozenset[str]]]:
        self.listed += 1
        if self.down:
            raise UpstreamUnavailable("Triton is unavailable (unavailable)")
        return [(name, state, dict(params), self.inputs) for name, state, params in self.models]

    async def close(self) -> None:
        self.closed = True

    # supervision (gateway/supervisor.py): a fake model process never dies unless a test says so
    async def probe(self, triton_model: str, timeout: float = 5.0) -> bool | None:
        return triton_model not in self.dead

    def abort(self, triton_model: str, error: Exception) -> int:
        return 0

    async def model_state(self, triton_model: str, timeout: float = 5.0) -> str | None:
        return next((state for name, state, _ in self.models if name == triton_model), None)

    async def reload(self, triton_model: str) -> None:
        self.reloads.append(triton_model)
        self.dead.discard(triton_model)

    async def tokenize(self, triton_model: str, task: TokenizerTask, request_id: str) -> TokenizerResult:
        """A whitespace tokenizer: word i has id i; ids detokenize to `t<id>` words."""
        self.tokenizer_calls.append(task)
        if self.down:
            raise UpstreamUnavailable("Triton is unavailable (unavailable)")
        if task.detokenize is not None:
            return TokenizerResult(list(task.detokenize), " ".join(f"t{i}" for i in task.detokenize), 2048)
        text = task.prompt if task.prompt is not None else " ".join(m["content"] or "" for m in task.messages or ())
        words = text.split()
        return TokenizerResult(list(range(len(words))), "", 2048, words)

    async def generate(self, triton_model: str, req: GenerationRequest, request_id: str
                       ) -> AsyncIterator[GenerationEvent]:
        call = Call(triton_model, req, request_id)
        self.calls.append(call)
        steps = self.script(req) if callable(self.script) else list(self.script)
        try:
            for step in steps:
                if isinstance(step, Delay):
                    await asyncio.sleep(step.seconds)
                elif isinstance(step, Hang):
                    await asyncio.Event().wait()
                elif isinstance(step, BaseException):
                    raise step
                else:
                    call.sent += 1
                    call.first_sent.set()
                    yield step
            call.completed = True
        except (asyncio.CancelledError, GeneratorExit):
            call.cancelled = True
            raise
        finally:
            call.closed = True


class Gateway:
    def __init__(self, settings: Settings, fakes: dict[str, FakeTriton]) -> None:
        self.settings = settings
        self.fakes = fakes
        self.registry = ModelRegistry(settings, client_factory=lambda url: fakes[url])
        # the app wires the supervisor; tests hold it to probe on demand (no lifespan runs the probe loop here)
        self.supervisor = ModelSupervisor(self.registry, settings)
        self.app = DisconnectAware(create_app(settings, self.registry, supervisor=self.supervisor))
        self.client = httpx.AsyncClient(transport=httpx.ASGITransport(app=self.app), base_url="http://gateway")

    def fake(self, url: str = "a") -> FakeTriton:
        return self.fakes[url]

    @property
    def calls(self) -> list[Call]:
        """Every call on every endpoint, in the order the gateway made them."""
        return sorted((c for f in self.fakes.values() for c in f.calls), key=lambda c: c.order)

    def served_by(self) -> list[str]:
        """The endpoint url of each call, in call order."""
        return [url for _, url in sorted((c.order, url) for url, f in self.fakes.items() for c in f.calls)]

    async def chat(self, headers: dict[str, str] | None = None, **body: Any) -> httpx.Response:
        payload = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], **body}
        return await self.client.post("/v1/chat/completions", json=payload, headers=headers)

    async def generate(self, model: str = SIE_MODEL, headers: dict[str, str] | None = None,
                       **body: Any) -> httpx.Response:
        payload = {"prompt": "Once upon", "max_new_tokens": 16, **body}
        return await self.client.post(f"/v1/generate/{model}", json=payload, headers=headers)


def one_pool(*endpoints: EndpointConfig, name: str = "default", machine_profile: str = "default") -> PoolConfig:
    return PoolConfig(name, machine_profile, endpoints or (EndpointConfig(url="a"),))


@pytest.fixture
async def make_gateway() -> AsyncIterator[Callable[..., Any]]:
    """`await make_gateway(pools=..., **settings)`: a gateway whose registry has already refreshed."""
    made: list[Gateway] = []

    async def build(*, pools: tuple[PoolConfig, ...] | None = None, refresh: bool = True,
                    setup: Callable[[dict[str, FakeTriton]], None] | None = None, **overrides: Any) -> Gateway:
        pools = pools or (one_pool(),)
        settings = Settings(pools=pools, **overrides)
        fakes = {e.url: FakeTriton(e.url) for p in pools for e in p.endpoints}
        if setup is not None:
            setup(fakes)
        gw = Gateway(settings, fakes)
        if refresh:
            await gw.registry.refresh()
        made.append(gw)
        return gw

    yield build
    for gw in made:
        await gw.client.aclose()


@pytest.fixture
async def gw(make_gateway: Callable[..., Any]) -> Gateway:
    return await make_gateway()


# -- envelopes ----------------------------------------------------------------------------------

def assert_error(resp: httpx.Response, status: int, code: str, param: str | None = None,
                 type_: str | None = None) -> dict[str, Any]:
    """The OpenAI envelope with X-SIE-Error-Code and the SIE headers; returns `error`."""
    assert resp.status_code == status, (resp.status_code, resp.text)
    assert resp.headers["content-type"].startswith("application/json")
    body = resp.json()
    assert set(body) == {"error"}, body
    err = body["error"]
    assert {"message", "type", "param", "code"} <= set(err), err
    assert isinstance(err["message"], str) and err["message"]
    assert err["code"] == code, err
    assert err["param"] == param, err
    if type_ is not None:
        assert err["type"] == type_, err
    assert resp.headers["x-sie-error-code"] == code
    assert_sie_headers(resp)
    return err


def assert_sie_headers(resp: httpx.Response) -> None:
    request_id = resp.headers["x-sie-request-id"]
    assert request_id and request_id.isascii() and request_id == request_id.strip() and len(request_id) <= 256
    assert resp.headers["x-sie-server-version"]


# -- raw ASGI (for client disconnects) ---------------------------------------------------------

@dataclass
class RawExchange:
    status: int | None = None
    headers: dict[str, str] = field(default_factory=dict)
    chunks: list[bytes] = field(default_factory=list)
    first_body: asyncio.Event = field(default_factory=asyncio.Event)
    disconnect: asyncio.Event = field(default_factory=asyncio.Event)


def raw_call(app: Any, path: str, body: dict[str, Any], headers: dict[str, str] | None = None
             ) -> tuple[RawExchange, Callable[[], Any]]:
    """An ASGI exchange whose client disconnects when the test sets `exchange.disconnect`."""
    exchange = RawExchange()
    raw = json.dumps(body).encode()
    scope = {
        "type": "http", "asgi": {"version": "3.0", "spec_version": "2.3"}, "http_version": "1.1",
        "method": "POST", "scheme": "http", "path": path, "raw_path": path.encode(), "query_string": b"",
        "root_path": "", "server": ("gateway", 80), "client": ("127.0.0.1", 5000),
        "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(raw)).encode()),
                    *((k.lower().encode(), v.encode()) for k, v in (headers or {}).items())],
    }
    sent_body = False

    async def receive() -> dict[str, Any]:
        nonlocal sent_body
        if not sent_body:
            sent_body = True
            return {"type": "http.request", "body": raw, "more_body": False}
        await exchange.disconnect.wait()
        return {"type": "http.disconnect"}

    async def send(message: dict[str, Any]) -> None:
        if message["type"] == "http.response.start":
            exchange.status = message["status"]
            exchange.headers = {k.decode().lower(): v.decode() for k, v in message["headers"]}
        elif message["type"] == "http.response.body" and message.get("body"):
            exchange.chunks.append(message["body"])
            exchange.first_body.set()

    async def run() -> None:
        await app(scope, receive, send)

    return exchange, run

