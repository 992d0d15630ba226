"""Shared by the contract property tests: any JSON value in any field is a 200-able request or a
400 whose `param` names that field (never another exception)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from hypothesis import strategies as st

from gateway.domain import GenerationRequest
from gateway.errors import GatewayError

JSON_VALUES = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=8),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4),
    max_leaves=12,
)


def check_any_value(parse: Callable[[dict[str, Any]], GenerationRequest], body: Callable[..., dict[str, Any]],
                    field: str, value: Any) -> None:
    try:
        result = parse(body(**{field: value}))
    except GatewayError as err:
        assert err.param is None or err.param == field or err.param.startswith((f"{field}.", f"{field}[")), (
            field,
            value,
            err.param,
        )
        assert err.status == 400
    else:
        assert isinstance(result, GenerationRequest)
