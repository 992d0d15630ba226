"""schemathesis against the served /openapi.json with the real SmolLM2 behind the real tritonserver.

The stub-model fuzz (test_fuzz_openapi.py) covers the gateway's parsing; this one lets generated bodies reach the
engine: half of them name the served model (and the native route's path names it), so the tokenizer, chat template,
sampler settings, grammars and stop handling meet whatever the schema allows. Generation is kept short (the caps
below), so the budget buys breadth. Every answer is below 500, every 4xx is in the error envelope, nothing hangs,
and the stack still answers a plain request afterwards.
"""

from __future__ import annotations

import httpx
import pytest
import schemathesis
from hypothesis import HealthCheck, given, settings

from tests.helpers.envelope import check_fuzzed_answer

from .conftest import MODEL, SIE_MODEL, Stack

# the body fields that set how much is generated, kept small so each case costs about a second
CAPS = {"max_tokens": 8, "max_completion_tokens": 8, "max_output_tokens": 16, "max_new_tokens": 8, "n": 2,
        "best_of": 2}


# the operation's own length field, set where a case leaves it out (the defaults run to the context's end)
LENGTH_FIELD = {"/v1/chat/completions": "max_tokens", "/v1/completions": "max_tokens",
                "/v1/generate/{model}": "max_new_tokens", "/v1/responses": "max_output_tokens"}


def _aim_at_the_model(case, path: str, draw_model: bool) -> None:
    """Half the cases name the served model; every generation-size field is capped (never raised)."""
    if "model" in case.path_parameters:
        case.path_parameters["model"] = SIE_MODEL
    body = case.body
    if not isinstance(body, dict):
        return
    if draw_model:
        body["model"] = MODEL
    if not any(field in body for field in ("max_tokens", "max_completion_tokens")):
        body.setdefault(LENGTH_FIELD[path], CAPS[LENGTH_FIELD[path]])
    for field, cap in CAPS.items():
        value = body.get(field)
        if isinstance(value, int) and not isinstance(value, bool) and value > cap:
            body[field] = cap


@pytest.mark.parametrize("operation", ["POST /v1/chat/completions", "POST /v1/completions",
                                       "POST /v1/generate/{model}", "POST /v1/responses"])
def test_generated_requests_to_the_real_model_get_no_5xx_and_enveloped_4xx(stack: Stack, operation: str):
    schema = schemathesis.openapi.from_url(stack.base_url + "/openapi.json")
    method, path = operation.split(" ")
    op = schema[path][method]
    hits: list[int] = []

    @settings(max_examples=25, deadline=None, suppress_health_check=list(HealthCheck), database=None)
    @given(case=op.as_strategy())
    def run(case) -> None:
        _aim_at_the_model(case, path, draw_model=len(hits) % 2 == 0)
        response = case.call(timeout=60)
        hits.append(response.status_code)
        check_fuzzed_answer(response)

    run()
    assert hits, "schemathesis generated no case"
    plain = httpx.post(f"{stack.base_url}/v1/chat/completions", timeout=60,
                       json={"model": MODEL, "max_tokens": 4, "messages": [{"role": "user", "content": "Hi"}]})
    assert plain.status_code == 200, plain.text
