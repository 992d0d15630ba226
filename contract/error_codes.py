"""The one error table of the gateway <-> Triton contract (docs/triton-contract.md).

For each code a model may report: the Triton error status the model sends it with, and the HTTP status,
OpenAI error type and `Retry-After` the gateway answers with. The engine's Triton glue and the gateway both
read this table. It imports nothing, so the gateway (which never imports torch) can read it.
"""

from __future__ import annotations

from typing import NamedTuple


class ErrorCode(NamedTuple):
    triton: str  # the `pb_utils.TritonError` status name (what the gRPC client sees)
    http: int
    type: str  # OpenAI error type in the envelope
    retry_after: float | None = None


_BAD_REQUEST = ErrorCode("INVALID_ARG", 400, "invalid_request_error")

ERROR_CODES: dict[str, ErrorCode] = {
    "invalid_request": _BAD_REQUEST,
    "unsupported_field": _BAD_REQUEST,
    "grammar_invalid": _BAD_REQUEST,
    "grammar_compile_failed": _BAD_REQUEST,
    "unknown_lora_adapter": _BAD_REQUEST,
    # run-time LoRA (docs/lora.md): an unload while requests use the adapter; a load past the profile's max_loras
    "lora_adapter_in_use": ErrorCode("INVALID_ARG", 409, "invalid_request_error"),
    "lora_capacity_exceeded": ErrorCode("INVALID_ARG", 409, "invalid_request_error"),
    "context_exceeded": ErrorCode("INVALID_ARG", 400, "context_length_exceeded"),
    "cancelled": ErrorCode("CANCELLED", 408, "server_error"),
    "rate_limit_exceeded": ErrorCode("UNAVAILABLE", 429, "rate_limit_error", 1),
    "QUEUE_FULL": ErrorCode("UNAVAILABLE", 503, "server_error", 1),
    "MODEL_LOADING": ErrorCode("UNAVAILABLE", 503, "server_error", 5),
    "RESOURCE_EXHAUSTED": ErrorCode("UNAVAILABLE", 503, "server_error", 5),
    "transport_failure": ErrorCode("UNAVAILABLE", 503, "server_error", 5),
    "MODEL_OUTPUT_PARSE_ERROR": ErrorCode("INTERNAL", 500, "server_error"),
}

# Any other code (an engine fault): the gateway reports it as `inference_error`.
UNKNOWN_CODE = "inference_error"
UNKNOWN = ErrorCode("INTERNAL", 500, "server_error")


def lookup(code: str) -> ErrorCode:
    return ERROR_CODES.get(code, UNKNOWN)
