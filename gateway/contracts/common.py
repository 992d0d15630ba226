"""Shared pieces of the request contracts: the strict base model, field types, error mapping.

Every contract violation leaves this package as a `GatewayError` built in ONE place,
`gateway_error`, from the first pydantic error. Validators never raise gateway errors directly
(that would bypass pydantic's ordering); they raise `violation(...)`, a pydantic custom error
that carries our code, the rule text and the path below the validator's own location.
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping
from typing import Annotated, Any, ClassVar, TypeVar

from pydantic import (
    AfterValidator,
    BaseModel,
    ConfigDict,
    Field,
    ValidationError,
    WithJsonSchema,
    model_validator,
)
from pydantic_core import PydanticCustomError

from gateway.errors import GatewayError, InvalidRequest, UnsupportedField, quoted

INVALID = "invalid_request"
UNSUPPORTED = "unsupported_field"

I64_MIN = -(2**63)
I64_MAX = 2**63 - 1
U32_MAX = 2**32 - 1
MAX_LOGIT_BIAS_ENTRIES = 1024
# stop strings: OpenAI allows 4, vLLM any number; ours bound what the engine holds per candidate (its matching
# cost per token does not depend on them, see engine/text/stop_strings.py)
MAX_STOP_SEQUENCES = 32
MAX_STOP_LENGTH = 256  # characters

PathPart = str | int


def violation(rule: str, *suffix: PathPart, code: str = INVALID, message: str | None = None) -> PydanticCustomError:
    """A contract error for a validator to raise.

    `rule` completes the sentence "'<param>' ..."; `suffix` is appended to the validator's own
    location to form `param`; `message` replaces the whole sentence when a dedicated text is due.
    """
    ctx = {"suffix": suffix, "rule": rule, "message": message}
    # The template is fixed so that user text (keys, refs) is never run through formatting.
    return PydanticCustomError(code, "contract violation", ctx)


def format_param(loc: tuple[PathPart, ...]) -> str | None:
    """`("messages", 2, "content", 0)` -> `messages[2].content[0]`."""
    out = ""
    for part in loc:
        if isinstance(part, int):
            out += f"[{part}]"
        else:
            out += f".{part}" if out else str(part)
    return out or None


def _bound_rule(etype: str, ctx: Mapping[str, Any]) -> str | None:
    bounds = {
        "greater_than": (">", "gt"),
        "greater_than_equal": (">=", "ge"),
        "less_than": ("<", "lt"),
        "less_than_equal": ("<=", "le"),
    }
    if etype not in bounds:
        return None
    symbol, key = bounds[etype]
    return f"must be {symbol} {ctx.get(key)}"


_TYPE_RULES: dict[str, str] = {
    "missing": "is required",
    "string_type": "must be a string",
    "int_type": "must be an integer",
    "int_from_float": "must be an integer",
    "int_too_large": "is out of range (an integer must fit in 64 bits)",
    "bool_type": "must be a boolean",
    "float_type": "must be a number",
    "finite_number": "must be a finite number",
    "list_type": "must be an array",
    "dict_type": "must be an object",
    "model_type": "must be an object",
    "model_attributes_type": "must be an object",
    "extra_forbidden": "is not supported by this endpoint",
}


def _huge_integer_literal(value: Any) -> bool:
    """orjson reads an integer literal beyond 64 bits as a float: the client sent an integer, a too large one."""
    return isinstance(value, float) and value.is_integer() and abs(value) >= 2.0**63


def _builtin_rule(etype: str, ctx: Mapping[str, Any]) -> str:
    """Our own wording for a pydantic error type (pydantic's text never reaches clients)."""
    if etype in _TYPE_RULES:
        return _TYPE_RULES[etype]
    if etype == "string_too_short":
        n = ctx.get("min_length", 1)
        return "must be a non-empty string" if n == 1 else f"must be at least {n} characters"
    if etype == "string_too_long":
        return f"must be at most {ctx.get('max_length')} characters"
    if etype == "too_short":
        n = ctx.get("min_length")
        return "must not be empty" if n == 1 else f"must have at least {n} items"
    if etype == "too_long":
        return f"must have at most {ctx.get('max_length')} items"
    if etype == "literal_error":
        return f"must be {ctx.get('expected')}"
    return _bound_rule(etype, ctx) or "is invalid"


def gateway_error(exc: ValidationError) -> GatewayError:
    """Turn the FIRST pydantic error into our exception (the one mapping for all contracts)."""
    errors = exc.errors(include_url=False, include_input=True)
    if not errors:  # pragma: no cover - pydantic always reports at least one
        return InvalidRequest("request is invalid")
    err = errors[0]
    etype = err["type"]
    if etype in ("int_type", "int_from_float") and _huge_integer_literal(err.get("input")):
        etype = "int_too_large"
    ctx: Mapping[str, Any] = err.get("ctx") or {}
    loc = tuple(err["loc"])
    if etype in (INVALID, UNSUPPORTED):
        param = format_param(loc + tuple(ctx.get("suffix", ())))
        message = ctx.get("message") or _sentence(param, str(ctx.get("rule")))
        cls: type[InvalidRequest] = UnsupportedField if etype == UNSUPPORTED else InvalidRequest
        return cls(message, param=param)
    param = format_param(loc)
    cls = UnsupportedField if etype == "extra_forbidden" else InvalidRequest
    return cls(_sentence(param, _builtin_rule(etype, ctx)), param=param)


def _sentence(param: str | None, rule: str) -> str:
    return f"'{param}' {rule}" if param else f"request {rule}"


M = TypeVar("M", bound=BaseModel)


def validate_body(model: type[M], body: Any) -> M:
    """Validate an already-decoded JSON body against a contract model, raising `GatewayError`."""
    if not isinstance(body, dict):
        raise InvalidRequest("request body must be a JSON object", param=None)
    try:
        return model.model_validate(body)
    except ValidationError as exc:
        raise gateway_error(exc) from None


class ContractModel(BaseModel):
    """Strict base: no coercion, no NaN/inf, null means absent, unknown keys rejected first."""

    model_config = ConfigDict(strict=True, extra="forbid", allow_inf_nan=False)

    # Code for an unknown key; None means unknown keys are dropped silently.
    unknown_key_code: ClassVar[str | None] = UNSUPPORTED
    # Report an unknown key on the object itself (`options`) rather than on the key.
    unknown_key_on_self: ClassVar[bool] = False
    # Known-rejected keys with a dedicated rule text.
    rejected_keys: ClassVar[Mapping[str, str]] = {}

    @model_validator(mode="before")
    @classmethod
    def _screen_keys(cls, data: Any) -> Any:
        if not isinstance(data, dict):
            return data  # pydantic reports model_type -> "must be an object"
        cls.check_raw(data)
        allowed = {f.alias or name for name, f in cls.model_fields.items()}
        unknown = sorted((k for k in data if k not in allowed), key=str)
        if unknown and cls.unknown_key_code is not None:
            key = str(unknown[0])
            if cls.unknown_key_on_self:
                raise violation(f"has unknown key {quoted(key)}", code=cls.unknown_key_code)
            rule = cls.rejected_keys.get(key, "is not supported by this endpoint")
            raise violation(rule, key, code=cls.unknown_key_code)
        # Null means absent: dropping it lets defaults apply and "missing" fire for required fields.
        return {k: v for k, v in data.items() if v is not None and k in allowed}

    @classmethod
    def check_raw(cls, data: dict[str, Any]) -> None:
        """Hook for checks on the raw object before any field is validated."""


# ---- field types shared by both contracts --------------------------------------------------


def _check_i64(value: int) -> int:
    if not I64_MIN <= value <= I64_MAX:
        raise violation("must be a signed 64-bit integer")
    return value


NonEmptyStr = Annotated[str, Field(min_length=1)]
Temperature = Annotated[float, Field(ge=0)]
TopP = Annotated[float, Field(gt=0, le=1)]
Penalty = Annotated[float, Field(ge=-2, le=2)]
TopK = Annotated[int, Field(ge=1)]
Seed = Annotated[
    int,
    AfterValidator(_check_i64),
    WithJsonSchema({"type": "integer", "minimum": I64_MIN, "maximum": I64_MAX}),
]
TopLogprobs = Annotated[int, Field(ge=0, le=20)]
# SIE extension, vLLM's meaning: lower runs earlier, 0 the default. The bound keeps it a small number the engine's
# scheduler can sort on; a key may be held to a narrower range (gateway/key_settings.py)
Priority = Annotated[int, Field(ge=-1000, le=1000)]


def is_number(value: Any) -> bool:
    """A JSON number (bool excluded, as strict mode does)."""
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def stop_sequences(value: Any, *, allow_string: bool) -> tuple[str, ...]:
    """`stop` as a tuple; an empty array means absent and empty strings are rejected."""
    if isinstance(value, str) and allow_string:
        items: list[Any] = [value]
    elif isinstance(value, list):
        items = value
    else:
        kind = "a string or an array of strings" if allow_string else "an array of strings"
        raise violation(f"must be {kind}")
    if not all(isinstance(s, str) for s in items):
        raise violation("must contain only strings")
    if any(s == "" for s in items):
        raise violation("must not contain empty strings")
    if len(items) > MAX_STOP_SEQUENCES:
        raise violation(f"must have at most {MAX_STOP_SEQUENCES} entries")
    if any(len(s) > MAX_STOP_LENGTH for s in items):
        raise violation(f"entries must be at most {MAX_STOP_LENGTH} characters")
    return tuple(items)


_TOKEN_ID = re.compile(r"[0-9]{1,19}")


def logit_bias_map(value: Any) -> dict[int, float] | None:
    """`logit_bias` as `{token_id: bias}`; `{}` means absent."""
    if not isinstance(value, dict):
        raise violation("must be an object mapping token ids to biases")
    if len(value) > MAX_LOGIT_BIAS_ENTRIES:
        raise violation(f"must have at most {MAX_LOGIT_BIAS_ENTRIES} entries")
    out: dict[int, float] = {}
    for key, bias in value.items():
        if not isinstance(key, str) or not _TOKEN_ID.fullmatch(key) or int(key) > I64_MAX:
            raise violation("keys must be integer token ids")
        if not is_number(bias) or not math.isfinite(bias) or not -100 <= bias <= 100:
            raise violation("values must be finite numbers in [-100, 100]")
        out[int(key)] = float(bias)
    return out or None


STOP_SCHEMA: dict[str, Any] = {"anyOf": [{"type": "string"}, {"type": "array", "items": {"type": "string"}}]}
LOGIT_BIAS_SCHEMA: dict[str, Any] = {
    "type": "object",
    "additionalProperties": {"type": "number", "minimum": -100, "maximum": 100},
    "maxProperties": MAX_LOGIT_BIAS_ENTRIES,
}
