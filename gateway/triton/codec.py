"""Gateway <-> Triton tensor contract (docs/triton-contract.md): request encoding, response decoding.

Works on the raw protobufs so the per-chunk hot path is a few struct reads, not numpy round trips.
"""

from __future__ import annotations

import struct
from typing import Any

import orjson
from tritonclient.grpc import service_pb2

from gateway.domain import GenerationEvent, GenerationRequest

_INT32 = struct.Struct("<i")
_LEN = struct.Struct("<I")


def _bytes_tensor(request: service_pb2.ModelInferRequest, name: str, items: list[bytes]) -> None:
    """A 1-D BYTES tensor: Triton's wire form is a 4-byte little-endian length before each item."""
    tensor = request.inputs.add()
    tensor.name = name
    tensor.datatype = "BYTES"
    tensor.shape.append(len(items))
    request.raw_input_contents.append(b"".join(_LEN.pack(len(b)) + b for b in items))


def encode_request(triton_model: str, req: GenerationRequest, request_id: str) -> service_pb2.ModelInferRequest:
    request = service_pb2.ModelInferRequest(model_name=triton_model, id=request_id)
    if req.messages is not None:
        _bytes_tensor(request, "messages", [orjson.dumps(list(req.messages))])
    else:
        _bytes_tensor(request, "text_input", [(req.prompt or "").encode("utf-8")])
    _bytes_tensor(request, "sampling_parameters", [orjson.dumps(req.sampling_parameters())])
    stream = request.inputs.add()
    stream.name, stream.datatype = "stream", "BOOL"
    stream.shape.append(1)
    request.raw_input_contents.append(b"\x01" if req.stream else b"\x00")
    if req.images:
        _bytes_tensor(request, "images", [img.data for img in req.images])
    return request


class MalformedResponse(ValueError):
    pass


def _read_bytes(raw: bytes) -> bytes:
    if len(raw) < 4:
        raise MalformedResponse("BYTES tensor too short")
    (n,) = _LEN.unpack_from(raw, 0)
    return raw[4 : 4 + n]


def decode_response(response: service_pb2.ModelInferResponse) -> tuple[GenerationEvent, bool]:
    """One model response -> (event, is_final). Raises MalformedResponse on contract violations."""
    raw = dict(zip((o.name for o in response.outputs), response.raw_output_contents, strict=False))
    try:
        text = _read_bytes(raw["text_output"]).decode("utf-8")
        (index,) = _INT32.unpack(raw["index"])
        finish = _read_bytes(raw["finish_reason"]).decode() or None
        (prompt_tokens,) = _INT32.unpack(raw["prompt_tokens"])
        (completion_tokens,) = _INT32.unpack(raw["completion_tokens"])
        (final,) = raw["is_final"]
        logprobs_raw = _read_bytes(raw["logprobs"])
        extras_raw = _read_bytes(raw["extras"])
        extras: dict[str, Any] = orjson.loads(extras_raw) if extras_raw else {}
        logprobs = orjson.loads(logprobs_raw) if logprobs_raw else None
        if not isinstance(extras, dict):
            raise ValueError("extras is not a JSON object")
    except (KeyError, struct.error, UnicodeDecodeError, ValueError) as exc:  # orjson errors are ValueErrors
        raise MalformedResponse(f"model response violates the tensor contract: {exc}") from None
    event = GenerationEvent(
        index=index,
        text=text,
        finish_reason=finish,
        logprobs=logprobs,
        tool_calls=extras.get("tool_calls"),
        reasoning=extras.get("reasoning_content"),
        prompt_tokens=prompt_tokens,
        completion_tokens=completion_tokens,
        stop_reason=extras.get("stop_reason"),
        ttft_ms=extras.get("ttft_ms"),
        tpot_ms=extras.get("tpot_ms"),
        cached_tokens=int(extras.get("cached_tokens") or 0),
    )
    return event, bool(final)


def parse_error_message(message: str) -> tuple[str, str, str | None]:
    """A model error carries JSON `{code, param, message}`; anything else is a server-side failure."""
    start = message.find("{")
    if start >= 0:
        try:
            data = orjson.loads(message[start:])
            if isinstance(data, dict) and isinstance(data.get("code"), str):
                return data["code"], str(data.get("message", "")), data.get("param")
        except orjson.JSONDecodeError:
            pass
    return "inference_error", "the model failed to process the request", None
