"""Async gRPC client for one Triton endpoint: streaming generation and model discovery.

One bidirectional `ModelStreamInfer` call per HTTP request; the request side stays open while the request
runs. A call is never left to the server to tidy up:
- a request that finished (final response or error): half-close, then read the call to its OK status;
- a generation its consumer left early (client gone, timeout): a stop request on the same call, then the same
  (contract/stop_call.py);
- a call that broke, or does not end within `_END_CALL_TIMEOUT_S`: cancel, which Triton turns into
  `request.is_cancelled()` in the model.
Why not cancel more: tritonserver 2.51 now and then aborts when a call is cancelled while the model still sends
on it, and keeps about 9 kB per cancelled call for good (18,000 cancelled calls grew it 42 -> 214 MB).
"""
from __future__ import annotations

import asyncio
import contextlib
import re
import secrets
from collections.abc import AsyncGenerator, AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Any, TypeVar

import grpc
from tritonclient.grpc import service_pb2, service_pb2_grpc

from gateway.domain import GenerationEvent, GenerationRequest, TokenizerResult, TokenizerTask
from gateway.errors import (
    GatewayError,
    MalformedWorkerResponse,
    ModelProcessDied,
    Unavailable,
    UnsupportedField,
    worker_error,
)
from gateway.triton.codec import (
    MalformedResponse,
    decode_lora_adapters,
    decode_response,
    decode_tokenizer_response,
    encode_lora_control,
    encode_request,
    encode_stop,
    encode_tokenizer_request,
    is_final,
    parse_error_message,
)

T = TypeVar("T")

_CHANNEL_OPTIONS = [
    ("grpc.max_send_message_length", 64 * 1024 * 1024),
    ("grpc.max_receive_message_length", 64 * 1024 * 1024),
    ("grpc.keepalive_time_ms", 30_000),
    # Reconnect within about 2 s of Triton coming back, however long it was down: gRPC's default backoff grows
    # 1 s x 1.6 per failed attempt up to 120 s, so after a 100 s outage a worker answered 503 for another
    # 56 s. Attempts to a down endpoint cost one refused connect every 2 s. `min_reconnect_backoff_ms` is
    # also the connect deadline of one attempt (default 20 s).
    ("grpc.initial_reconnect_backoff_ms", 500),
    ("grpc.min_reconnect_backoff_ms", 1_000),
    ("grpc.max_reconnect_backoff_ms", 2_000),
]
# Triton ends a half-closed call within a round trip once its request is done, and a stopped one within a step of
# the engine (a long prefill chunk at worst); past this, cancel.
_END_CALL_TIMEOUT_S = 5.0
# Triton's own refusals of a request no model instance has seen: a server that is shutting down (its models
# unloading: "Request for unknown model: 'x' has no available versions"), or a model not loaded here.
_NOT_SERVED_HERE = ("Request for unknown model", "Server not ready", "is not at ready state")
# Triton's refusal of an input the model's config does not declare: a model repository older than token-id prompts
_UNDECLARED_TOKEN_IDS = "unexpected inference input 'prompt_token_ids'"
# The Python backend's answer, after about 1 s, to a request for an instance whose stub process is gone. Triton
# itself never restarts that process and keeps the model READY (triton-inference-server/server #7862, #8604).
_STUB_DEAD = re.compile(r"Stub process '([^']*)' is not healthy")
# A model load can take minutes (weights, warm-up); unload returns at once.
_LOAD_TIMEOUT_S = 900.0


@dataclass(eq=False)
class _InFlight:
    """One open call, so that `abort` can end it with an error of our choosing."""

    call: grpc.aio.StreamStreamCall
    error: GatewayError | None = field(default=None)


class UpstreamUnavailable(Unavailable):
    """Triton could not be reached (connection refused, reset, shutting down)."""

    code = "transport_failure"


class TritonClient:
    def __init__(self, url: str) -> None:
        self.url = url
        self._channel: grpc.aio.Channel | None = None
        self._stub: service_pb2_grpc.GRPCInferenceServiceStub | None = None
        self._in_flight: dict[str, set[_InFlight]] = {}  # Triton model -> its open calls

    @property
    def stub(self) -> service_pb2_grpc.GRPCInferenceServiceStub:
        # created lazily so the channel binds to the running event loop of this worker
        if self._stub is None:
            self._channel = grpc.aio.insecure_channel(self.url, options=_CHANNEL_OPTIONS)
            self._stub = service_pb2_grpc.GRPCInferenceServiceStub(self._channel)
        return self._stub

    async def close(self) -> None:
        if self._channel is not None:
            await self._channel.close()
            self._channel = self._stub = None

    async def generate(
        self, triton_model: str, req: GenerationRequest, request_id: str
    ) -> AsyncGenerator[GenerationEvent, None]:
        """Yield the model's events for one request; raises GatewayError subclasses on failure."""
        # aclosing: a consumer that stops early (client gone) must end the Triton call now, not at GC
        call_id = secrets.token_hex(16)  # names this call alone: a stop request cannot reach another client's
        request = encode_request(triton_model, req, request_id, call_id)
        async with contextlib.aclosing(self._responses(request, call_id)) as responses:
            async for response in responses:
                try:
                    event, _ = decode_response(response)
                except MalformedResponse as exc:
                    raise MalformedWorkerResponse(str(exc)) from None
                yield event

    async def tokenize(self, triton_model: str, task: TokenizerTask, request_id: str) -> TokenizerResult:
        """Tokenize (a prompt, or chat messages through the template) or detokenize; generates nothing."""
        return await self._answer(encode_tokenizer_request(triton_model, task, request_id), decode_tokenizer_response)

    async def lora_control(self, triton_model: str, control: dict[str, Any], request_id: str) -> list[str]:
        """Load, unload or list the model's LoRA adapters (docs/triton-contract.md); returns those it serves after."""
        return await self._answer(encode_lora_control(triton_model, control, request_id), decode_lora_adapters)

    async def _answer(self, request: service_pb2.ModelInferRequest,
                      decode: Callable[[service_pb2.ModelInferResponse], T]) -> T:
        """A control request's one answer (its final response), decoded."""
        result: T | None = None
        async with contextlib.aclosing(self._responses(request)) as responses:
            async for response in responses:
                try:
                    result = decode(response)
                except MalformedResponse as exc:
                    raise MalformedWorkerResponse(str(exc)) from None
        if result is None:  # pragma: no cover - _responses raises when the stream ends without a response
            raise UpstreamUnavailable("the model stream ended before the request finished")
        return result

    async def _responses(
        self, request: service_pb2.ModelInferRequest, call_id: str | None = None
    ) -> AsyncGenerator[service_pb2.ModelInferResponse, None]:
        """The request's infer responses up to its final one; the call is ended after (module docstring). A
        generation carries `call_id`, so that a consumer that leaves early stops it rather than cancel it."""
        outbox: asyncio.Queue[service_pb2.ModelInferRequest | None] = asyncio.Queue()
        outbox.put_nowait(request)

        async def requests() -> AsyncIterator[service_pb2.ModelInferRequest]:
            while (item := await outbox.get()) is not None:
                yield item

        call = self.stub.ModelStreamInfer(requests())
        entry = _InFlight(call)
        calls = self._in_flight.setdefault(request.model_name, set())
        calls.add(entry)
        request_done = False  # Triton sent the request's last response: end the call, do not cancel it
        broken = False
        answered = False
        try:
            async for response in call:
                if response.error_message:
                    request_done = True  # the engine's errors end the request
                    if dead := _STUB_DEAD.search(response.error_message):
                        raise ModelProcessDied(f"the model process of '{request.model_name}' ({dead.group(1)}) "
                                               "is dead; the model is being reloaded, retry shortly")
                    if not answered and any(s in response.error_message for s in _NOT_SERVED_HERE):
                        # nothing ran: another endpoint can take it (a draining Triton keeps its connections)
                        raise UpstreamUnavailable(f"Triton did not take the request: {response.error_message[:120]}")
                    if not answered and _UNDECLARED_TOKEN_IDS in response.error_message:
                        raise UnsupportedField("this model does not take a prompt as token ids; send it as text",
                                               param="prompt")
                    raise worker_error(*parse_error_message(response.error_message))
                answered = True
                request_done = is_final(response.infer_response)
                yield response.infer_response
                if request_done:
                    return
            request_done = True  # the call ended: nothing left to stop
            raise UpstreamUnavailable("the model stream ended before the request finished")
        except (grpc.aio.AioRpcError, asyncio.CancelledError) as exc:
            broken = isinstance(exc, grpc.aio.AioRpcError)
            if entry.error is not None:  # ended by `abort`: its reason, not the cancellation it caused
                raise entry.error from None
            if isinstance(exc, asyncio.CancelledError):
                raise
            raise _rpc_error(exc) from None
        finally:
            calls.discard(entry)
            stop = None
            if not (request_done or broken) and entry.error is None and call_id is not None:
                stop = encode_stop(request.model_name, call_id, request.id)
            await _end_call(call, outbox, request_done and not broken, stop)

    def abort(self, triton_model: str, error: GatewayError) -> int:
        """End every open call of `triton_model` with `error` (its process died: Triton would leave them
        silent for good). Returns how many were open."""
        calls = list(self._in_flight.get(triton_model, ()))
        for entry in calls:
            entry.error = error
            entry.call.cancel()
        return len(calls)

    async def probe(self, triton_model: str, timeout: float = 5.0) -> bool | None:
        """Whether the model's process is alive: False when the backend says it is dead, None when unknown
        (no answer in time, Triton unreachable).

        The probe is a request with no inputs: every model of ours refuses it at once ("a prompt or messages
        is required") without running anything, and a dead instance is answered by the backend itself."""
        request = service_pb2.ModelInferRequest(model_name=triton_model, id="sie-liveness-probe")
        try:
            async with asyncio.timeout(timeout), contextlib.aclosing(self._responses(request)) as responses:
                async for _ in responses:
                    break  # any answer from the instance: it is alive
        except ModelProcessDied:
            return False
        except (TimeoutError, UpstreamUnavailable):
            return None
        except GatewayError:
            return True  # the model's own refusal: it is alive
        return True

    async def model_state(self, triton_model: str, timeout: float = 5.0) -> str | None:
        """The model's state in Triton's repository index (READY, LOADING, UNLOADING, UNAVAILABLE), or None."""
        index = await self.stub.RepositoryIndex(service_pb2.RepositoryIndexRequest(), timeout=timeout)
        return next((m.state for m in index.models if m.name == triton_model), None)

    async def reload(self, triton_model: str) -> None:
        """Unload then load the model through Triton's repository API (tritonserver runs with
        --model-control-mode=explicit). A plain load of a loaded model whose files did not change is a
        no-op, so the unload is what replaces the dead instance. Raises grpc.aio.AioRpcError on failure."""
        await self.stub.RepositoryModelUnload(service_pb2.RepositoryModelUnloadRequest(model_name=triton_model),
                                              timeout=30)
        await self.stub.RepositoryModelLoad(service_pb2.RepositoryModelLoadRequest(model_name=triton_model),
                                            timeout=_LOAD_TIMEOUT_S)

    async def list_models(self, timeout: float = 5.0) -> list[tuple[str, str, dict[str, str], frozenset[str]]]:
        """(name, state, parameters, declared input names) for every model in the repository index."""
        index = await self.stub.RepositoryIndex(service_pb2.RepositoryIndexRequest(), timeout=timeout)
        models = []
        for entry in index.models:
            params: dict[str, str] = {}
            inputs: frozenset[str] = frozenset()
            if entry.state == "READY":
                config = await self.stub.ModelConfig(service_pb2.ModelConfigRequest(name=entry.name), timeout=timeout)
                params = {k: v.string_value for k, v in config.config.parameters.items()}
                inputs = frozenset(tensor.name for tensor in config.config.input)
            models.append((entry.name, entry.state, params, inputs))
        return models


async def _end_call(call: grpc.aio.StreamStreamCall, outbox: asyncio.Queue[service_pb2.ModelInferRequest | None],
                    request_done: bool, stop: service_pb2.ModelInferRequest | None) -> None:
    """Half-close the call and read it to its OK status: at once when its request is done, after `stop` when its
    generation is to be stopped. Cancel it when neither applies, or when it does not end in time."""
    ended = False
    try:
        if request_done or stop is not None:
            if stop is not None:
                outbox.put_nowait(stop)
            outbox.put_nowait(None)  # half-close
            async with asyncio.timeout(_END_CALL_TIMEOUT_S):
                async for _ in call:
                    pass  # a stopped generation's last tokens and its final `cancelled` error; then the OK status
            ended = True
    except (TimeoutError, grpc.aio.AioRpcError):
        pass
    finally:
        if not ended:
            outbox.put_nowait(None)
            call.cancel()  # stops the Triton request: the model sees request.is_cancelled()


def _rpc_error(exc: grpc.aio.AioRpcError) -> BaseException:
    status = exc.code()
    if status == grpc.StatusCode.CANCELLED:
        return asyncio.CancelledError()
    return UpstreamUnavailable(f"Triton is unavailable ({status.name.lower()})", retry_after=5)
