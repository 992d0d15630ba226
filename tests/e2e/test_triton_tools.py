"""Triton's own tools drive our models without the gateway: perf_analyzer's input format (what genai-perf 0.0.16
writes with `--endpoint-type kserve --backend vllm`) sent over tritonclient's gRPC stream to the real tritonserver.

perf_analyzer reads a JSON data file whose rows map input names to lists, takes each input's datatype from the
model's metadata, and streams the row as one request. `_infer_inputs` does the same."""

from __future__ import annotations

import json
import queue
from typing import Any

import httpx
import numpy as np
import pytest
import tritonclient.grpc as grpcclient

from tests.e2e.conftest import SIE_MODEL

TRITON_MODEL = "smollm2_135m_instruct"
PROMPT = "The capital of France is"

_NUMPY = {"BYTES": np.object_, "BOOL": np.bool_, "INT32": np.int32, "UINT32": np.uint32}


def _genai_perf_row(prompt: str, tokens: int, stream: bool = True, **extra: Any) -> dict[str, list[Any]]:
    """One row of genai-perf's `inputs.json` for the vLLM backend: token counts are strings."""
    row: dict[str, list[Any]] = {
        "text_input": [prompt],
        "stream": [stream],
        "exclude_input_in_output": [True],
        "sampling_parameters": [json.dumps({"max_tokens": str(tokens), "min_tokens": str(tokens),
                                            "temperature": "0"})],
    }
    row.update({k: [v] for k, v in extra.items()})
    return row


@pytest.fixture(scope="module")
def triton(stack):
    client = grpcclient.InferenceServerClient(f"127.0.0.1:{stack.triton.grpc}")
    yield client
    client.close()


def _infer_inputs(client: grpcclient.InferenceServerClient, row: dict[str, list[Any]]) -> list[grpcclient.InferInput]:
    """As perf_analyzer builds them: every input of the row must be in the model's metadata (else it fails with
    "The input or output '...' is not found in the model configuration"), with the datatype declared there."""
    declared = {i.name: i.datatype for i in client.get_model_metadata(TRITON_MODEL).inputs}
    inputs = []
    for name, values in row.items():
        assert name in declared, f"perf_analyzer would fail: '{name}' is not in the model configuration"
        datatype = declared[name]
        data = np.array([v.encode() if isinstance(v, str) else v for v in values], dtype=_NUMPY[datatype])
        tensor = grpcclient.InferInput(name, list(data.shape), datatype)
        tensor.set_data_from_numpy(data)
        inputs.append(tensor)
    return inputs


def _stream(client: grpcclient.InferenceServerClient, row: dict[str, list[Any]], outputs: list[str] | None = None):
    """Every response of one streamed request, until the one with Triton's final flag."""
    results: queue.Queue = queue.Queue()
    client.start_stream(callback=lambda result, error: results.put((result, error)))
    try:
        requested = [grpcclient.InferRequestedOutput(n) for n in outputs] if outputs else None
        client.async_stream_infer(TRITON_MODEL, _infer_inputs(client, row), outputs=requested,
                                  enable_empty_final_response=True)
        got = []
        while True:
            result, error = results.get(timeout=120)
            got.append((result, error))
            if error is not None:
                return got
            if result.get_response().parameters["triton_final_response"].bool_param:
                return got
    finally:
        client.stop_stream()


def _texts(got) -> list[str]:
    texts = []
    for result, error in got:
        assert error is None, error
        out = result.as_numpy("text_output")
        if out is not None:
            texts.append(out.reshape(-1)[0].decode())
    return texts


def _gateway_text(stack, tokens: int) -> str:
    r = httpx.post(f"{stack.base_url}/v1/generate/{SIE_MODEL}",
                   json={"prompt": PROMPT, "max_new_tokens": tokens, "temperature": 0,
                         "options": {"default_sampling": {"min_new_tokens": tokens}}},
                   timeout=60)
    assert r.status_code == 200, r.text
    return r.json()["text"]


def test_genai_perf_streaming_request(stack, triton):
    """The exact request genai-perf makes: string token counts, exclude_input_in_output, streaming."""
    got = _stream(triton, _genai_perf_row(PROMPT, 8))
    texts = _texts(got)
    assert len([t for t in texts if t]) >= 2, "a streamed request must stream"
    # the reference: the same greedy request through the gateway gives the same text
    assert "".join(texts) == _gateway_text(stack, 8)
    last = got[-1][0]
    assert last.as_numpy("completion_tokens").reshape(-1)[0] == 8


def test_vllm_output_counts_and_echoed_prompt(triton):
    """exclude_input_in_output=false echoes the prompt (blocking); return_num_*_tokens add the vLLM outputs."""
    row = _genai_perf_row(PROMPT, 5, stream=False, return_num_input_tokens=True, return_num_output_tokens=True)
    row["exclude_input_in_output"] = [False]
    got = _stream(triton, row)
    text = "".join(_texts(got))
    assert text.startswith(PROMPT) and len(text) > len(PROMPT)
    counts = [r.as_numpy("num_output_tokens") for r, _ in got if r.as_numpy("num_output_tokens") is not None]
    assert sum(int(c.reshape(-1)[0]) for c in counts) == 5
    prompt_tokens = [int(r.as_numpy("num_input_tokens").reshape(-1)[0]) for r, _ in got
                     if r.as_numpy("num_input_tokens") is not None]
    assert prompt_tokens and set(prompt_tokens) == {int(got[-1][0].as_numpy("prompt_tokens").reshape(-1)[0])}


@pytest.mark.parametrize(
    ("params", "param"),
    [({"max_tokens": "eight"}, "max_tokens"), ({"max_tokens": 4, "seed": "7"}, "seed"),
     ({"max_tokens": 4, "repetition_penalty": 0}, "repetition_penalty")],
)
def test_bad_sampling_parameters_are_a_clear_error(triton, params, param):
    row = _genai_perf_row(PROMPT, 4)
    row["sampling_parameters"] = [json.dumps(params)]
    got = _stream(triton, row)
    error = got[-1][1]
    assert error is not None
    body = json.loads(str(error.message())[str(error.message()).index("{"):])
    assert (body["code"], body["param"]) == ("invalid_request", param)
