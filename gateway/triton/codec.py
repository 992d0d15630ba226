"""Gateway <-> Triton tensor contract (docs/triton-contract.md): request encoding, response decoding.

Works on the raw protobufs so the per-chunk hot path is a few struct reads, not numpy round trips.
"""

from __future__ import annotations

import struct
from collections.abc import Sequence
from typing import Any

import orjson
from tritonclient.grpc import service_pb2

from contract.stop_call import CALL_PARAMETER, STOP_PARAMETER
from gateway.domain import GenerationEvent, GenerationRequest, TokenizerResult, TokenizerTask

_INT32 = struct.Struct("<i")
_LEN = struct.Struct("<I")


def _bytes_tensor(request: service_pb2.ModelInferRequest, name: str, items: list[bytes]) -> None:
    """A 1-D BYTES tensor: Triton's wire form is a 4-byte little-endian length before each item."""
    tensor = request.inputs.add()
    tensor.name = name
    tensor.datatype = "BYTES"
    tensor.shape.append(len(items))
    request.raw_input_contents.append(b"".join(_LEN.pack(len(b)) + b for b in items))


def _int64_tensor(request: service_pb2.ModelInferRequest, name: str, values: Sequence[int]) -> None:
    tensor = request.inputs.add()
    tensor.name, tensor.datatype = name, "INT64"
    tensor.shape.append(len(values))
    request.raw_input_contents.append(struct.pack(f"<{len(values)}q", *values))


def encode_request(triton_model: str, req: GenerationRequest, request_id: str,
                   call_id: str | None = None) -> service_pb2.ModelInferRequest:
    """`call_id`: the gateway's id for the call, which a stop request names (contract/stop_call.py)."""
    request = service_pb2.ModelInferRequest(model_name=triton_model, id=request_id)
    if call_id is not None:
        request.parameters[CALL_PARAMETER].string_param = call_id
    if req.messages is not None:
        _bytes_tensor(request, "messages", [orjson.dumps(list(req.messages))])
    elif req.prompt_token_ids is not None:
        _int64_tensor(request, "prompt_token_ids", req.prompt_token_ids)
    else:
        _bytes_tensor(request, "text_input", [(req.prompt or "").encode("utf-8")])
    _bytes_tensor(request, "sampling_parameters", [orjson.dumps(req.sampling_parameters())])
    stream = request.inputs.add()
    stream.name, stream.datatype = "stream", "BOOL"
    stream.shape.append(1)
    request.raw_input_contents.append(b"\x01" if req.stream else b"\x00")
    if req.images:
        _bytes_tensor(request, "images", [img.data for img in req.images])
    if req.cache_salt is not None:
        _bytes_tensor(request, "cache_salt", [req.cache_salt.encode()])
    if req.tenant is not None:
        _bytes_tensor(request, "tenant", [orjson.dumps({"id": req.tenant, "weight": req.tenant_weight})])
    return request


def encode_stop(triton_model: str, call_id: str, request_id: str) -> service_pb2.ModelInferRequest:
    """The control request that ends the generation `call_id` on the same call: no inputs, nothing generated."""
    request = service_pb2.ModelInferRequest(model_name=triton_model, id=f"{request_id}/stop")
    request.parameters[STOP_PARAMETER].string_param = call_id
    return request


def encode_tokenizer_request(triton_model: str, task: TokenizerTask,
                             request_id: str) -> service_pb2.ModelInferRequest:
    """`tokenize` (options JSON, with `text_input` or `messages`) or `detokenize` (INT64 ids): no generation."""
    request = service_pb2.ModelInferRequest(model_name=triton_model, id=request_id)
    if task.detokenize is not None:
        _int64_tensor(request, "detokenize", task.detokenize)
        return request
    if task.messages is not None:
        _bytes_tensor(request, "messages", [orjson.dumps(list(task.messages))])
    else:
        _bytes_tensor(request, "text_input", [(task.prompt or "").encode("utf-8")])
    _bytes_tensor(request, "tokenize", [orjson.dumps(task.options)])
    return request


def encode_lora_control(triton_model: str, control: dict[str, Any], request_id: str) -> service_pb2.ModelInferRequest:
    """A run-time LoRA request (`lora_control`: {"action", "lora_name", "lora_path"}): nothing generated."""
    request = service_pb2.ModelInferRequest(model_name=triton_model, id=request_id)
    _bytes_tensor(request, "lora_control", [orjson.dumps(control)])
    return request


def decode_lora_adapters(response: service_pb2.ModelInferResponse) -> list[str]:
    """The adapters a model serves after a `lora_control` request: its `extras.lora_adapters`."""
    raw = dict(zip((o.name for o in response.outputs), response.raw_output_contents, strict=False))
    if "extras" not in raw:
        raise MalformedResponse("lora_control response without extras")
    extras_raw = _read_bytes(raw["extras"])
    names = (orjson.loads(extras_raw) if extras_raw else {}).get("lora_adapters")
    if not isinstance(names, list) or not all(isinstance(n, str) for n in names):
        raise MalformedResponse("lora_control response without extras.lora_adapters")
    return names


def is_final(response: service_pb2.ModelInferResponse) -> bool:
    """The `is_final` output of a response (absent: not final; the decoder reports the violation)."""
    for output, raw in zip(response.outputs, response.raw_output_contents, strict=False):
        if output.name == "is_final":
            return bool(raw[:1] == b"\x01")
    return False


def decode_tokenizer_response(response: service_pb2.ModelInferResponse) -> TokenizerResult:
    """The answer to a tokenizer request: `extras.token_ids` (+ `token_strs`, `max_model_len`), `text_output`."""
    event, _ = decode_response(response)
    raw = dict(zip((o.name for o in response.outputs), response.raw_output_contents, strict=False))
    extras_raw = _read_bytes(raw["extras"])
    extras = orjson.loads(extras_raw) if extras_raw else {}
    ids = extras.get("token_ids")
    if not isinstance(ids, list) or not all(isinstance(t, int) for t in ids):
        raise MalformedResponse("tokenizer response without extras.token_ids")
    strs = extras.get("token_strs")
    return TokenizerResult(token_ids=ids, text=event.text, max_model_len=int(extras.get("max_model_len") or 0),
                           token_strs=strs if isinstance(strs, list) else None)


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


def parse_error_message(message: str) -> tuple[str, str, str | None, tuple[int, int] | None]:
    """A model error carries JSON `{code, param, message, usage?}`; anything else is a server-side failure.

    Returns (code, message, param, usage); usage is (prompt, completion) tokens when the model counted them."""
    start = message.find("{")
    if start >= 0:
        try:
            data = orjson.loads(message[start:])
            if isinstance(data, dict) and isinstance(data.get("code"), str):
                return data["code"], str(data.get("message", "")), data.get("param"), _usage(data.get("usage"))
        except orjson.JSONDecodeError:
            pass
    return "inference_error", "the model failed to process the request", None, None


def _usage(raw: object) -> tuple[int, int] | None:
    if not isinstance(raw, dict):
        return None
    counts = raw.get("prompt_tokens"), raw.get("completion_tokens")
    if all(type(n) is int and n >= 0 for n in counts):
        return counts[0], counts[1]  # type: ignore[return-value]
    return None
