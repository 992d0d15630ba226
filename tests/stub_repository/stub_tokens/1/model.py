"""Stub decoupled model (no torch): emits `max_tokens` one-word tokens per request, in the real tensor contract.

Used to measure the transport alone (bench/gateway.py) and to test the gateway against a real
tritonserver without model cost. A per-request thread sends, as the real engine's sender does.
From tritonserver's environment: SIE_STUB_TOKEN_DELAY_S (default 0) paces a stream, that long between tokens;
SIE_STUB_TOKEN_TEXT (default `tok `) is each token's text, so a test can tell two stub servers apart.
"""

import json
import os
import sys
import threading
import time

# Same as the real models: the dev stack's venv (its numpy) must shadow the base interpreter's.
_paths = [p for p in os.environ.get("SIE_PYTHONPATH", "").split(os.pathsep) if p]
sys.path[:0] = [p for p in _paths if p not in sys.path]

import numpy as np  # noqa: E402
import triton_python_backend_utils as pb_utils  # noqa: E402


def _bytes(value: bytes) -> np.ndarray:
    return np.array([value], dtype=np.object_)


def _response(text: str, finish: str, prompt: int, completion: int, final: bool):
    tensors = [
        pb_utils.Tensor("text_output", _bytes(text.encode())),
        pb_utils.Tensor("index", np.array([0], dtype=np.int32)),
        pb_utils.Tensor("finish_reason", _bytes(finish.encode())),
        pb_utils.Tensor("prompt_tokens", np.array([prompt], dtype=np.int32)),
        pb_utils.Tensor("completion_tokens", np.array([completion], dtype=np.int32)),
        pb_utils.Tensor("logprobs", _bytes(b"")),
        pb_utils.Tensor("is_final", np.array([final], dtype=np.bool_)),
        pb_utils.Tensor("extras", _bytes(b"")),
    ]
    return pb_utils.InferenceResponse(output_tensors=tensors)


class TritonPythonModel:
    def initialize(self, args):
        self.final = pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL
        self.token_delay_s = float(os.environ.get("SIE_STUB_TOKEN_DELAY_S") or 0)
        self.token = os.environ.get("SIE_STUB_TOKEN_TEXT") or "tok "
        self.calls: dict[str, threading.Event] = {}  # the gateway's call id -> its stop

    def execute(self, requests):
        for request in requests:
            call_params = json.loads(request.parameters() or "{}")
            if "sie_stop" in call_params:  # the gateway's stop for a call it left (contract/stop_call.py)
                stop = self.calls.get(call_params["sie_stop"])
                if stop is not None:
                    stop.set()
                request.get_response_sender().send(flags=self.final)
                continue
            stop = threading.Event()
            if "sie_call" in call_params:
                self.calls[call_params["sie_call"]] = stop
            raw = pb_utils.get_input_tensor_by_name(request, "sampling_parameters")
            params = json.loads(raw.as_numpy().reshape(-1)[0]) if raw is not None else {}
            stream_t = pb_utils.get_input_tensor_by_name(request, "stream")
            stream = bool(stream_t.as_numpy().reshape(-1)[0]) if stream_t is not None else False
            threading.Thread(target=self._emit, args=(request, int(params.get("max_tokens", 16)), stream, stop,
                                                      call_params.get("sie_call")), daemon=True).start()
        return None

    def _emit(self, request, n: int, stream: bool, stop: threading.Event, call: str | None) -> None:
        try:
            self._emit_tokens(request, request.get_response_sender(), n, stream, stop)
        finally:
            self.calls.pop(call, None)

    def _emit_tokens(self, request, sender, n: int, stream: bool, stop: threading.Event) -> None:
        if not stream:
            sender.send(_response(self.token * n, "length", 3, n, True), flags=self.final)
            return
        for i in range(n):
            if stop.is_set() or request.is_cancelled():  # as the engine ends a cancelled request: a final error
                sender.send(pb_utils.InferenceResponse(error=pb_utils.TritonError("request cancelled")),
                            flags=self.final)
                return
            last = i == n - 1
            if self.token_delay_s:
                time.sleep(self.token_delay_s)
            flags = self.final if last else 0
            sender.send(_response(self.token, "length" if last else "", 3, i + 1, last), flags=flags)
