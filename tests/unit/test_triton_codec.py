"""gateway/triton/codec.py and client.py: request encoding, response decoding, error parsing and every mapping from
what Triton sends to what the gateway raises. Encodings are checked against tritonclient's own (de)serializers."""

from __future__ import annotations

import asyncio
import json
import struct
from typing import Any

import grpc
import numpy as np
import orjson
import pytest
from tritonclient.grpc import service_pb2
from tritonclient.utils import deserialize_bytes_tensor, serialize_byte_tensor

from contract.error_codes import ERROR_CODES
from contract.stop_call import CALL_PARAMETER, STOP_PARAMETER
from engine.sampling_params import SamplingParams
from gateway.domain import GenerationRequest, GrammarSpec, ImageInput
from gateway.errors import GatewayError, MalformedWorkerResponse
from gateway.triton import client as client_mod
from gateway.triton.client import TritonClient, UpstreamUnavailable
from gateway.triton.codec import MalformedResponse, decode_response, encode_request, parse_error_message


def _req(**kw: Any) -> GenerationRequest:
    base: dict[str, Any] = {"model": "m", "max_tokens": 8, "max_tokens_param": "max_tokens", "prompt": "Hi"}
    return GenerationRequest(**{**base, **kw})


def _inputs(request: service_pb2.ModelInferRequest) -> dict[str, tuple[str, list[int], bytes]]:
    return {t.name: (t.datatype, list(t.shape), raw)
            for t, raw in zip(request.inputs, request.raw_input_contents, strict=True)}


def _triton_bytes(item: bytes) -> bytes:
    return serialize_byte_tensor(np.array([item], dtype=np.object_)).item()


def _bytes_items(raw: bytes) -> list[bytes]:
    return [bytes(x) for x in deserialize_bytes_tensor(raw)]


# -- encode ----------------------------------------------------------------------------------------------------

def test_encode_prompt_request():
    request = encode_request("tm", _req(stream=True), "rid-1")
    assert (request.model_name, request.id) == ("tm", "rid-1")
    inputs = _inputs(request)
    assert set(inputs) == {"text_input", "sampling_parameters", "stream"}
    dtype, shape, raw = inputs["text_input"]
    assert (dtype, shape, _bytes_items(raw)) == ("BYTES", [1], [b"Hi"])
    assert inputs["stream"] == ("BOOL", [1], b"\x01")
    assert json.loads(_bytes_items(inputs["sampling_parameters"][2])[0]) == {"max_tokens": 8, "n": 1,
                                                                         "max_tokens_param": "max_tokens"}
    # the same bytes tritonclient would put on the wire
    assert raw == _triton_bytes(b"Hi")


def test_encode_messages_images_and_blocking():
    messages = ({"role": "user", "content": "héllo"},)
    images = (ImageInput(b"\x89PNG-one", "png"), ImageInput(b"\xff\xd8-two", "jpeg"))
    inputs = _inputs(encode_request("tm", _req(prompt=None, messages=messages, images=images), "r"))
    assert "text_input" not in inputs
    assert json.loads(_bytes_items(inputs["messages"][2])[0]) == list(messages)
    assert inputs["images"][:2] == ("BYTES", [2])
    assert _bytes_items(inputs["images"][2]) == [b"\x89PNG-one", b"\xff\xd8-two"]
    assert inputs["stream"][2] == b"\x00"


def test_a_tenant_salt_is_its_own_input_and_never_in_the_repr():
    salted = _req(cache_salt="0f1e2d3c4b5a69788796a5b4c3d2e1f0")
    inputs = _inputs(encode_request("tm", salted, "r"))
    assert inputs["cache_salt"][:2] == ("BYTES", [1])
    assert _bytes_items(inputs["cache_salt"][2]) == [b"0f1e2d3c4b5a69788796a5b4c3d2e1f0"]
    assert "cache_salt" not in _inputs(encode_request("tm", _req(), "r"))  # the shared cache: no input at all
    assert "0f1e2d3c4b5a" not in repr(salted)


def test_the_engine_takes_a_salt_of_1_to_256_characters_and_never_echoes_it():
    from engine.errors import EngineError
    from engine.triton.intake import checked_cache_salt

    assert checked_cache_salt(None) is None and checked_cache_salt("t" * 256) == "t" * 256
    for bad in ("", "secret-tenant" * 20):
        with pytest.raises(EngineError) as raised:
            checked_cache_salt(bad)
        assert raised.value.param == "cache_salt" and raised.value.code == "invalid_request"
        assert bad == "" or "secret-tenant" not in raised.value.message


def test_every_sampling_parameter_the_gateway_sends_is_accepted_by_the_engine():
    """Both sides of the contract: what encode_request writes, SamplingParams.from_dict reads without error."""
    req = _req(
        temperature=0.5, top_p=0.9, top_k=5, min_tokens=1, repetition_penalty=1.1, presence_penalty=0.5,
        frequency_penalty=-0.5, logit_bias={5: 1.5}, seed=-(2**63), stop=("END",), logprobs=True, top_logprobs=3,
        n=2, best_of=3, lora_adapter="pirate", ignore_eos=True,
        grammar=GrammarSpec("regex", "a+", "lbl", True), tools=({"type": "function", "function": {"name": "f"}},),
        tool_choice="auto", parallel_tool_calls=False, chat_template_kwargs={"enable_thinking": False},
        include_reasoning=True,
    )
    raw = _bytes_items(_inputs(encode_request("tm", req, "r"))["sampling_parameters"][2])[0]
    sent = orjson.loads(raw)
    params = SamplingParams.from_dict(sent)
    assert (params.seed, params.logit_bias, params.best_of, params.stop) == (-(2**63), {5: 1.5}, 3, ["END"])
    assert params.grammar is not None and (params.grammar.kind, params.grammar.strict) == ("regex", True)


# -- decode ----------------------------------------------------------------------------------------------------

def _response(**overrides: Any) -> service_pb2.ModelInferResponse:
    values: dict[str, Any] = {
        "text_output": ("BYTES", "ab"), "index": ("INT32", 1), "finish_reason": ("BYTES", "stop"),
        "prompt_tokens": ("INT32", 5), "completion_tokens": ("INT32", 3),
        "logprobs": ("BYTES", '[{"token": "a", "logprob": -0.1}]'), "is_final": ("BOOL", True),
        "extras": ("BYTES", '{"tool_calls": [{"id": "c"}], "reasoning_content": "r", "stop_reason": "END", '
                            '"ttft_ms": 1.5, "tpot_ms": 2.5}'),
    }
    values.update(overrides)
    response = service_pb2.ModelInferResponse(model_name="tm")
    for name, spec in values.items():
        if spec is None:
            continue
        dtype, value = spec
        out = response.outputs.add()
        out.name, out.datatype = name, dtype
        out.shape.append(1)
        if dtype == "BYTES":
            raw = value if isinstance(value, bytes) else _triton_bytes(value.encode())
        elif dtype == "INT32":
            raw = np.array([value], dtype=np.int32).tobytes()
        else:
            raw = np.array([value], dtype=np.bool_).tobytes()
        response.raw_output_contents.append(raw)
    return response


def test_decode_every_field():
    event, final = decode_response(_response())
    assert final is True
    assert (event.index, event.text, event.finish_reason) == (1, "ab", "stop")
    assert (event.prompt_tokens, event.completion_tokens) == (5, 3)
    assert event.logprobs == [{"token": "a", "logprob": -0.1}]
    assert (event.tool_calls, event.reasoning, event.stop_reason) == ([{"id": "c"}], "r", "END")
    assert (event.ttft_ms, event.tpot_ms) == (1.5, 2.5)


def test_decode_running_delta():
    event, final = decode_response(_response(finish_reason=("BYTES", ""), logprobs=("BYTES", ""),
                                             extras=("BYTES", ""), is_final=("BOOL", False)))
    assert final is False
    assert (event.finish_reason, event.logprobs, event.tool_calls) == (None, None, None)


def test_decode_ignores_extra_outputs():
    """The vLLM-backend outputs (num_output_tokens ...) may ride along; the gateway reads only its own."""
    event, _ = decode_response(_response(num_output_tokens=("INT32", 2)))
    assert event.text == "ab"


@pytest.mark.parametrize("broken", [
    {"text_output": None},
    {"is_final": None},
    {"index": ("BYTES", "one")},
    {"text_output": ("BYTES", b"\x02\x00")},  # shorter than its length prefix
    {"text_output": ("BYTES", b"\x02\x00\x00\x00\xff\xfe")},  # not UTF-8
    {"extras": ("BYTES", "[1, 2]")},
    {"extras": ("BYTES", "{nope")},
    {"logprobs": ("BYTES", "{nope")},
])
def test_decode_contract_violations(broken):
    with pytest.raises(MalformedResponse):
        decode_response(_response(**broken))


# -- errors ----------------------------------------------------------------------------------------------------

def test_parse_error_message():
    body = json.dumps({"code": "QUEUE_FULL", "param": None, "message": "engine queue is full"})
    assert parse_error_message(body) == ("QUEUE_FULL", "engine queue is full", None, None)
    # Triton may put its own words before the model's JSON
    assert parse_error_message("in model 'x': " + json.dumps({"code": "invalid_request", "param": "seed",
                                                                 "message": "m"})) == ("invalid_request", "m", "seed",
                                                                                       None)
    for opaque in ("Traceback (most recent call last): boom", "{not json", '{"message": "no code"}', "[1]"):
        assert parse_error_message(opaque) == ("inference_error", "the model failed to process the request", None,
                                               None)


def test_parse_error_message_reads_the_usage_at_failure():
    """The engine's error message carries the tokens used when the request failed (Triton drops the outputs of
    an error response); a malformed count is no count."""
    from engine.errors import EngineError

    sent = EngineError("inference_error", "sampling failed: RuntimeError").to_json(usage=(12, 3))
    assert parse_error_message(sent) == ("inference_error", "sampling failed: RuntimeError", None, (12, 3))
    for bad in ({"prompt_tokens": -1, "completion_tokens": 3}, {"prompt_tokens": 12}, {"prompt_tokens": True,
                "completion_tokens": 3}, {"prompt_tokens": "12", "completion_tokens": 3}, [12, 3]):
        body = json.dumps({"code": "inference_error", "param": None, "message": "m", "usage": bad})
        assert parse_error_message(body)[3] is None, bad


class _Call:
    """A fake `ModelStreamInfer` call: yields scripted responses, or raises an AioRpcError; then it ends as
    `end` says: "half_close" (Triton: with OK once the client has half-closed its request side), "now" (the
    server ended the stream) or "never" (a stuck call)."""

    def __init__(self, items: list[Any], end: str = "half_close") -> None:
        self.items = items
        self.end = end
        self.cancelled = False
        self.half_closed = asyncio.Event()
        self.requests: Any = None
        self.sent: list[service_pb2.ModelInferRequest] = []  # what the client wrote on the call, in order
        self._responses = self._gen()

    def __aiter__(self):
        return self._responses  # one response stream per call, however often it is iterated

    async def _gen(self):
        for item in self.items:
            if isinstance(item, BaseException):
                raise item
            yield item
        if self.end != "now":
            await self.half_closed.wait()
        if self.end == "never":
            await asyncio.Event().wait()

    async def _read_requests(self) -> None:
        async for request in self.requests:
            self.sent.append(request)
        self.half_closed.set()

    def cancel(self) -> None:
        self.cancelled = True


class _Stub:
    def __init__(self, items: list[Any], end: str) -> None:
        self.call = _Call(items, end)

    def ModelStreamInfer(self, requests):  # the gRPC method's name
        self.call.requests = requests
        asyncio.get_running_loop().create_task(self.call._read_requests())
        return self.call


def _client(items: list[Any], end: str = "half_close") -> tuple[TritonClient, _Stub]:
    client = TritonClient("fake:1")
    stub = _Stub(items, end)
    client._stub = stub  # type: ignore[assignment]
    return client, stub


async def _collect(client: TritonClient) -> list[Any]:
    return [event async for event in client.generate("tm", _req(), "rid")]


def _rpc(status: grpc.StatusCode) -> grpc.aio.AioRpcError:
    return grpc.aio.AioRpcError(status, grpc.aio.Metadata(), grpc.aio.Metadata(), details="x")


def _stream_response(**kw: Any) -> service_pb2.ModelStreamInferResponse:
    return service_pb2.ModelStreamInferResponse(**kw)


_RUNNING = _response(is_final=("BOOL", False), finish_reason=("BYTES", ""))


async def test_a_finished_request_ends_its_call_without_cancelling_it():
    """tritonserver 2.51 keeps ~9 kB per cancelled stream: a finished request half-closes and reads the call to
    its end instead (tests/e2e/test_triton_memory.py measures the server)."""
    client, stub = _client([_stream_response(infer_response=_RUNNING),
                            _stream_response(infer_response=_response()),
                            _stream_response(infer_response=_response(text_output=("BYTES", "never yielded")))])
    events = await _collect(client)
    assert [e.text for e in events] == ["ab", "ab"]
    assert stub.call.half_closed.is_set() and not stub.call.cancelled


async def test_an_engine_error_ends_its_call_without_cancelling_it():
    client, stub = _client([_stream_response(error_message=json.dumps({"code": "invalid_request", "message": "m"}))])
    with pytest.raises(GatewayError):
        await _collect(client)
    assert stub.call.half_closed.is_set() and not stub.call.cancelled


async def test_leaving_before_the_final_response_stops_the_generation_on_its_call():
    """tritonserver 2.51 may abort when a call is cancelled while the model still sends on it: a generation left
    early is stopped by a request on the same call that names it, then the call ends as a finished one does."""
    client, stub = _client([_stream_response(infer_response=_RUNNING), _stream_response(infer_response=_RUNNING)])
    events = client.generate("tm", _req(), "rid")
    assert (await anext(events)).text == "ab"
    await events.aclose()  # the HTTP client went away mid-stream
    generation, stop = stub.call.sent
    call_id = generation.parameters[CALL_PARAMETER].string_param
    assert len(call_id) >= 32 and generation.model_name == stop.model_name == "tm"
    assert stop.parameters[STOP_PARAMETER].string_param == call_id and not stop.inputs
    assert stub.call.half_closed.is_set() and not stub.call.cancelled


async def test_each_generation_has_its_own_call_id():
    ids = set()
    for _ in range(3):
        client, stub = _client([_stream_response(infer_response=_response())])
        await _collect(client)
        ids.add(stub.call.sent[0].parameters[CALL_PARAMETER].string_param)
    assert len(ids) == 3


async def test_a_stop_the_model_does_not_act_on_ends_in_a_cancel(monkeypatch):
    """A model repository older than the stop request leaves the generation running: the call is cancelled."""
    monkeypatch.setattr(client_mod, "_END_CALL_TIMEOUT_S", 0.05)
    client, stub = _client([_stream_response(infer_response=_RUNNING)], end="never")
    events = client.generate("tm", _req(), "rid")
    await anext(events)
    await events.aclose()
    assert len(stub.call.sent) == 2 and stub.call.cancelled


async def test_a_probe_that_gets_no_answer_in_time_cancels_its_call():
    client, stub = _client([], end="never")
    assert await client.probe("tm", timeout=0.05) is None
    assert stub.call.cancelled and len(stub.call.sent) == 1


async def test_a_call_that_does_not_end_after_its_final_response_is_cancelled(monkeypatch):
    monkeypatch.setattr(client_mod, "_END_CALL_TIMEOUT_S", 0.05)
    client, stub = _client([_stream_response(infer_response=_response())], end="never")
    assert [e.text for e in await _collect(client)] == ["ab"]
    assert stub.call.half_closed.is_set() and stub.call.cancelled


@pytest.mark.parametrize("code", sorted(ERROR_CODES) + ["kaboom"])
async def test_model_errors_map_through_the_table(code):
    message = json.dumps({"code": code, "param": "p", "message": "said no"})
    client, _ = _client([_stream_response(error_message=message)])
    with pytest.raises(GatewayError) as caught:
        await _collect(client)
    entry = ERROR_CODES.get(code)
    assert caught.value.status == (entry.http if entry else 500)
    assert caught.value.code == (code if entry else "inference_error")
    assert caught.value.message == "said no"


async def test_malformed_response_and_early_end():
    client, _ = _client([_stream_response(infer_response=_response(index=None))])
    with pytest.raises(MalformedWorkerResponse):
        await _collect(client)
    client, _ = _client([_stream_response(infer_response=_response(is_final=("BOOL", False)))], end="now")
    with pytest.raises(UpstreamUnavailable) as caught:
        await _collect(client)
    assert (caught.value.status, caught.value.code) == (503, "transport_failure")


@pytest.mark.parametrize("status", [s for s in grpc.StatusCode if s not in (grpc.StatusCode.OK,)])
async def test_every_grpc_status_of_the_call(status):
    """gRPC CANCELLED (Triton cancelled the request) surfaces as a cancellation; every other failure of the call
    itself is a retryable 503 transport_failure."""
    client, _ = _client([_rpc(status)])
    if status == grpc.StatusCode.CANCELLED:
        with pytest.raises(asyncio.CancelledError):
            await _collect(client)
        return
    with pytest.raises(UpstreamUnavailable) as caught:
        await _collect(client)
    err = caught.value
    assert (err.status, err.code, err.retry_after) == (503, "transport_failure", 5)
    assert status.name.lower() in err.message
    assert client_mod._rpc_error(_rpc(status)).__class__ is UpstreamUnavailable


def test_encode_a_token_id_prompt():
    """A completions prompt given as token ids goes as INT64 `prompt_token_ids`, with no text_input."""
    req = GenerationRequest(model="m", max_tokens=4, max_tokens_param="max_tokens",
                            prompt_token_ids=(504, 3575, 2**31 - 1))
    inputs = _inputs(encode_request("tiny", req, "r1"))
    assert "text_input" not in inputs and "messages" not in inputs
    assert inputs["prompt_token_ids"] == ("INT64", [3], struct.pack("<3q", 504, 3575, 2**31 - 1))
