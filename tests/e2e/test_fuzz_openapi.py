"""schemathesis against the served /openapi.json (stub model behind a real tritonserver):
no 5xx, every 4xx in the error envelope, no hang."""

from __future__ import annotations

import pytest
import schemathesis
from hypothesis import HealthCheck, given, settings

from tests.e2e.conftest import TOKEN
from tests.helpers.envelope import check_fuzzed_answer


@pytest.mark.parametrize("operation", ["POST /v1/chat/completions", "POST /v1/generate/{model}", "POST /v1/responses"])
def test_no_5xx_and_enveloped_4xx(stub, operation):
    schema = schemathesis.openapi.from_url(stub.url + "/openapi.json")
    method, path = operation.split(" ")
    op = schema[path][method]

    @settings(max_examples=60, deadline=None, suppress_health_check=list(HealthCheck))
    @given(case=op.as_strategy())
    def run(case) -> None:
        response = case.call(headers={"Authorization": f"Bearer {TOKEN}"}, timeout=30)
        check_fuzzed_answer(response)

    run()
