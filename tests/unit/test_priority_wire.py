"""Both sides of the Triton contract for scheduling: what the gateway encodes (`priority` in `sampling_parameters`,
the `tenant` input as JSON) is what the engine's intake reads back for EngineRequest, and the engine checks both
itself, since Triton's own clients reach it without the gateway."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from tritonclient.grpc import service_pb2
from tritonclient.utils import deserialize_bytes_tensor

from engine.errors import EngineError
from engine.sampling_params import SamplingParams
from engine.triton.intake import checked_priority, checked_tenant
from gateway.domain import GenerationRequest
from gateway.triton.codec import encode_request

TENANT = "0f1e2d3c4b5a69788796a5b4c3d2e1f0"


def _req(**kw: Any) -> GenerationRequest:
    return GenerationRequest(model="m", max_tokens=8, max_tokens_param="max_tokens", prompt="Hi", **kw)


def _bytes_inputs(request: service_pb2.ModelInferRequest) -> dict[str, str]:
    return {t.name: bytes(deserialize_bytes_tensor(raw)[0]).decode()
            for t, raw in zip(request.inputs, request.raw_input_contents, strict=True) if t.datatype == "BYTES"}


def test_priority_and_tenant_reach_the_engine_intake():
    req = _req(priority=-7, tenant=TENANT, tenant_weight=2.5, temperature=0.5)
    inputs = _bytes_inputs(encode_request("tm", req, "r"))
    assert json.loads(inputs["tenant"]) == {"id": TENANT, "weight": 2.5}
    params = json.loads(inputs["sampling_parameters"])
    assert params["priority"] == -7
    assert checked_priority(params) == -7
    SamplingParams.from_dict(params, {})  # what is left is sampling, which the engine takes as it is
    assert checked_tenant(inputs["tenant"]) == (TENANT, 2.5)
    assert TENANT not in repr(req)


def test_the_default_tenant_and_priority_send_nothing():
    inputs = _bytes_inputs(encode_request("tm", _req(), "r"))
    assert "tenant" not in inputs and "priority" not in json.loads(inputs["sampling_parameters"])
    assert checked_priority({"max_tokens": 8}) == 0 and checked_tenant(None) == (None, 1.0)


@pytest.mark.parametrize("value", [1001, -1001, 1.0, "1", True, None])
def test_the_engine_refuses_a_bad_priority_naming_it(value):
    with pytest.raises(EngineError) as raised:
        checked_priority({"priority": value})
    assert (raised.value.code, raised.value.param) == ("invalid_request", "priority")


@pytest.mark.parametrize("raw", ['"x"', "{", '{"weight": 1}', '{"id": ""}', '{"id": 5}', '{"id": "t", "weight": 0}',
                                 '{"id": "t", "weight": true}', '{"id": "t", "weight": "2"}',
                                 '{"id": "t", "weight": 1001}', '{"id": "' + "t" * 257 + '"}'])
def test_the_engine_refuses_a_bad_tenant_without_echoing_it(raw):
    with pytest.raises(EngineError) as raised:
        checked_tenant(raw)
    assert (raised.value.code, raised.value.param) == ("invalid_request", "tenant")
    assert "ttttt" not in raised.value.message


def test_every_model_declares_the_tenant_input_like_the_salt():
    configs = sorted(Path(__file__).resolve().parents[2].glob("model_repository/*/config.pbtxt"))
    assert configs
    for config in configs:
        text = config.read_text()
        assert '{ name: "tenant", data_type: TYPE_STRING, dims: [ 1 ], optional: true }' in text, config

