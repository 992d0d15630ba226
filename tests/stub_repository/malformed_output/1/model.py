"""A model that breaks the tensor contract (no `index`, no `is_final`): the gateway must answer 500
`malformed_worker_response` and stay healthy."""

import os
import sys

# Same as the real models: the dev stack's venv (its numpy) must shadow the base interpreter's.
_paths = [p for p in os.environ.get("SIE_PYTHONPATH", "").split(os.pathsep) if p]
sys.path[:0] = [p for p in _paths if p not in sys.path]

import numpy as np  # noqa: E402
import triton_python_backend_utils as pb_utils  # noqa: E402


class TritonPythonModel:
    def execute(self, requests):
        for request in requests:
            sender = request.get_response_sender()
            text = pb_utils.Tensor("text_output", np.array([b"garbage"], dtype=np.object_))
            sender.send(pb_utils.InferenceResponse(output_tensors=[text]),
                        flags=pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL)
        return None
