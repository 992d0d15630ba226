"""Errors the engine reports for one request; the Triton glue turns them into Triton errors."""

from __future__ import annotations

import json


class EngineError(Exception):
    """A per-request failure with a stable code the gateway maps to HTTP (see docs/triton-contract.md)."""

    def __init__(self, code: str, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.code = code
        self.message = message
        self.param = param

    def to_json(self, usage: tuple[int, int] | None = None) -> str:
        """The Triton error message; `usage` (prompt, completion tokens) is what the request had used when it
        failed: Triton drops an error response's output tensors, so the counts ride in the message."""
        body: dict[str, object] = {"code": self.code, "param": self.param, "message": self.message}
        if usage is not None:
            body["usage"] = {"prompt_tokens": usage[0], "completion_tokens": usage[1]}
        return json.dumps(body)


class QueueFull(EngineError):
    def __init__(self, message: str = "engine queue is full; retry later") -> None:
        super().__init__("QUEUE_FULL", message)


def invalid(message: str, param: str | None = None) -> EngineError:
    return EngineError("invalid_request", message, param)


def is_device_fault(exc: BaseException) -> bool:
    """A failure of the shared device state (CUDA error, device-side assert): no request can go on."""
    text = f"{type(exc).__name__}: {exc}"
    return type(exc).__name__ == "AcceleratorError" or "CUDA error" in text or "device-side assert" in text


def request_error(exc: BaseException, stage: str) -> EngineError:
    """The error that fails one request for `exc`; a device fault is not one request's: it is re-raised."""
    if is_device_fault(exc):
        raise exc
    if isinstance(exc, EngineError):
        return exc
    return EngineError("inference_error", f"{stage} failed: {type(exc).__name__}")
