"""One exception tree for the gateway; each class knows its HTTP status and contract code.

Handlers raise; `gateway.error_responses` turns any `GatewayError` into the OpenAI-style envelope
`{"error": {message, type, param, code}}` plus `X-SIE-Error-Code` (and `Retry-After` when set).
"""

from __future__ import annotations

from typing import Any

# torch-free: the error table imports nothing (engine/__init__.py imports nothing either)
from contract.error_codes import ERROR_CODES, UNKNOWN, UNKNOWN_CODE


class GatewayError(Exception):
    status: int = 500
    type: str = "server_error"
    code: str = "inference_error"

    def __init__(
        self,
        message: str,
        *,
        param: str | None = None,
        code: str | None = None,
        status: int | None = None,
        retry_after: float | None = None,
        extra: dict[str, Any] | None = None,
    ) -> None:
        super().__init__(message)
        self.message = message
        self.param = param
        if code is not None:
            self.code = code
        if status is not None:
            self.status = status
        self.retry_after = retry_after
        self.extra = extra or {}

    def body(self) -> dict[str, Any]:
        err: dict[str, Any] = {
            "message": self.message,
            "type": self.type,
            "param": self.param,
            "code": self.code,
        }
        err.update(self.extra)
        return {"error": err}

    header_code: str | None = None  # `X-SIE-Error-Code` when it differs from the body code

    def headers(self) -> dict[str, str]:
        headers = {"X-SIE-Error-Code": self.header_code or self.code}
        if self.retry_after is not None:
            headers["Retry-After"] = format_retry_after(self.retry_after)
        return headers


def quoted(value: object, limit: int = 64) -> str:
    """`value` quoted for an error message, cut to its first `limit` characters: a client's input is named,
    never echoed back whole (a 1 MB header must not come back in a 1 MB error)."""
    text = str(value)
    if len(text) <= limit:
        return f"'{text}'"
    return f"'{text[:limit]}...' ({len(text)} characters)"


def format_retry_after(seconds: float) -> str:
    return str(int(seconds)) if float(seconds).is_integer() else f"{seconds:g}"


class InvalidRequest(GatewayError):
    status = 400
    type = "invalid_request_error"
    code = "invalid_request"


class UnsupportedField(InvalidRequest):
    code = "unsupported_field"


class UnknownLoraAdapter(InvalidRequest):
    code = "unknown_lora_adapter"


class ContextExceeded(GatewayError):
    status = 400
    type = "context_length_exceeded"
    code = "context_exceeded"


class ModelNotFound(GatewayError):
    status = 404
    type = "model_not_found"
    code = "model_not_found"


class NotFound(GatewayError):
    """A routing target (pool) that does not exist."""

    status = 404
    type = "invalid_request_error"
    code = "invalid_request"


class Unauthorized(GatewayError):
    """401; `WWW-Authenticate` names the scheme (RFC 9110 11.6.1), with `invalid_token` when one was sent
    (RFC 6750 3.1)."""

    status = 401
    type = "authentication_error"
    code = "UNAUTHORIZED"

    def __init__(self, message: str, *, token_sent: bool = False) -> None:
        super().__init__(message)
        self.challenge = 'Bearer realm="sie"' + (', error="invalid_token"' if token_sent else "")

    def headers(self) -> dict[str, str]:
        return {**super().headers(), "WWW-Authenticate": self.challenge}


class PayloadTooLarge(GatewayError):
    status = 413
    type = "invalid_request_error"
    code = "invalid_request"


class RequestTimeout(GatewayError):
    """The client stopped sending its request body (a stalled upload or a slowloris)."""

    status = 408
    type = "invalid_request_error"
    code = "request_timeout"


class ServerMisconfigured(GatewayError):
    status = 500
    type = "server_error"
    code = "GATEWAY_AUTH_MISCONFIGURED"


class Unavailable(GatewayError):
    """Retryable capacity errors: MODEL_LOADING, QUEUE_FULL, PROVISIONING, transport_failure."""

    status = 503
    type = "server_error"
    code = "transport_failure"

    def __init__(self, message: str, *, retry_after: float | None = 5, **kw: Any) -> None:
        super().__init__(message, retry_after=retry_after, **kw)


class Provisioning(Unavailable):
    """No reachable Triton endpoint, or none healthy for the model or pool: capacity may come back
    (scale from zero, a restarting server). The SDK retries it under `wait_for_capacity`."""

    code = "PROVISIONING"


class MachineProfileNotConfigured(GatewayError):
    """`X-SIE-MACHINE-PROFILE` names a profile no pool of this gateway has (docs/contract.md, "Capacity and routing
    errors": 503 `GPU_NOT_CONFIGURED`). Configuration, not capacity: no `Retry-After`, so clients do not retry it."""

    status = 503
    type = "server_error"
    code = "GPU_NOT_CONFIGURED"


class ModelProcessDied(Unavailable):
    """A model instance's process died (killed, out of memory, the engine's fatal path): its requests are ended
    with this, and new ones get 503 MODEL_LOADING while the gateway reloads the model (gateway/supervisor.py)."""

    code = "MODEL_LOADING"


class PoolCapacityUnavailable(Unavailable):
    """A pool that is configured with no endpoints at all (capped at zero workers)."""

    header_code = "POOL_CAPACITY_UNAVAILABLE"


class UpstreamTimeout(GatewayError):
    status = 504
    type = "server_error"
    code = "overall_timeout"


class MalformedWorkerResponse(GatewayError):
    status = 500
    type = "server_error"
    code = "malformed_worker_response"


class WorkerError(GatewayError):
    """A terminal error reported by the model (engine) for one request; `usage` is (prompt, completion) tokens
    used when it failed, where the model said (docs/triton-contract.md, Errors)."""

    status = 500
    type = "server_error"
    code = "inference_error"
    usage: tuple[int, int] | None = None


def worker_error(code: str, message: str, param: str | None = None,
                 usage: tuple[int, int] | None = None) -> GatewayError:
    """Build the gateway error for a worker-reported code from the contract's one error table
    (contract/error_codes.py, shared with the model side); unknown codes → 500 inference_error."""
    entry = ERROR_CODES.get(code)
    if entry is None:
        entry = UNKNOWN
        if code != "malformed_worker_response":
            code = UNKNOWN_CODE
    err = WorkerError(message, param=param, code=code, status=entry.http, retry_after=entry.retry_after)
    err.type = entry.type
    err.usage = usage
    return err


def tokens_used(error: GatewayError, seen: tuple[int, int]) -> tuple[int, int]:
    """(prompt, completion) tokens of a request that ended with `error`: the model's own count when it sent one,
    else the most the stream's events had reported (`seen`)."""
    usage = error.usage if isinstance(error, WorkerError) else None
    return usage if usage is not None else seen
