"""`priority` (SIE extension, vLLM's meaning: lower runs earlier) on every generation API: an integer in
[-1000, 1000], default 0, carried to the engine in `sampling_parameters`; anything else is a 400 naming it."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest

from gateway.contracts.chat import parse_chat_request
from gateway.contracts.completions import parse_completion_request
from gateway.contracts.generate import parse_generate_request
from gateway.contracts.responses import parse_responses_request
from gateway.domain import GenerationRequest
from gateway.errors import GatewayError

Parse = Callable[[dict[str, Any]], GenerationRequest]

APIS: dict[str, tuple[dict[str, Any], Parse]] = {
    "chat": ({"model": "m", "messages": [{"role": "user", "content": "hi"}]}, parse_chat_request),
    "completions": ({"model": "m", "prompt": "hi"}, lambda b: parse_completion_request(b).request),
    "responses": ({"model": "m", "input": "hi"},
                  lambda b: parse_responses_request(b, default_max_tokens=16).generation_request()),
    "generate": ({"prompt": "hi", "max_new_tokens": 4}, lambda b: parse_generate_request(b, "m")),
}


@pytest.mark.parametrize("api", APIS)
@pytest.mark.parametrize("priority", [-1000, -3, 1, 1000])
def test_priority_is_carried_to_sampling_parameters(api, priority):
    base, parse = APIS[api]
    req = parse({**base, "priority": priority})
    assert req.priority == priority
    assert req.sampling_parameters()["priority"] == priority


@pytest.mark.parametrize("api", APIS)
@pytest.mark.parametrize("body", [{}, {"priority": None}, {"priority": 0}])
def test_absent_null_or_zero_is_the_default_and_not_sent(api, body):
    base, parse = APIS[api]
    req = parse({**base, **body})
    assert req.priority == 0 and "priority" not in req.sampling_parameters()


@pytest.mark.parametrize("api", APIS)
@pytest.mark.parametrize(("value", "rule"), [
    (1001, "must be <= 1000"), (-1001, "must be >= -1000"), (2**70, "must be <= 1000"),
    (1.5, "must be an integer"), (2.0, "must be an integer"), ("1", "must be an integer"), (True, "must be an integer"),
    ([1], "must be an integer"),
])
def test_a_bad_priority_is_a_400_naming_priority(api, value, rule):
    base, parse = APIS[api]
    with pytest.raises(GatewayError) as raised:
        parse({**base, "priority": value})
    err = raised.value
    assert (err.status, err.code, err.param) == (400, "invalid_request", "priority")
    assert err.body()["error"]["type"] == "invalid_request_error"
    assert rule in err.message
