"""Triton vLLM-backend compatibility: the optional inputs its clients send (perf_analyzer and genai-perf with
`--backend vllm`, tritonclient examples), so Triton's own tools drive our models (docs/triton-contract.md).

Declared in each model's config.pbtxt as optional BOOL [1] inputs:
- `exclude_input_in_output`: false prepends the prompt (`text_input`) to each choice's first response, as the
  vLLM backend does. Absent means true here: the gateway never wants the prompt echoed.
- `return_finish_reason`: accepted; `finish_reason` is always in our responses.
- `return_num_input_tokens` / `return_num_output_tokens`: add the vLLM backend's UINT32 outputs
  `num_input_tokens` (prompt tokens) and `num_output_tokens` (tokens in this response).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import numpy as np

from engine.errors import invalid

if TYPE_CHECKING:  # torch-free at run time
    from engine.request import RequestOutput

FLAG_INPUTS = ("exclude_input_in_output", "return_finish_reason", "return_num_input_tokens",
               "return_num_output_tokens")


class Reply:
    """One request's response sender and the output options it asked for. One object per request, so the
    outbox's coalescing (keyed on the sender's identity) still groups by request."""

    __slots__ = ("_prefixed", "_sent_tokens", "call_id", "num_input_tokens", "num_output_tokens", "prefix", "sender")

    def __init__(self, sender: Any, call_id: str | None = None) -> None:
        self.sender = sender
        self.call_id = call_id  # the gateway's id for the call, which its stop request names (contract/stop_call.py)
        self.prefix = ""  # prompt text to echo before each choice's first text
        self.num_input_tokens = False
        self.num_output_tokens = False
        self._prefixed: set[int] = set()
        self._sent_tokens: dict[int, int] = {}

    def configure(self, flags: dict[str, bool], prompt: str | None) -> None:
        """Apply the flags a request sent; `prompt` is its `text_input` (None for chat `messages`)."""
        if not flags.get("exclude_input_in_output", True):
            if prompt is None:
                raise invalid("exclude_input_in_output=false needs text_input (a prompt to echo)",
                              "exclude_input_in_output")
            self.prefix = prompt
        self.num_input_tokens = flags.get("return_num_input_tokens", False)
        self.num_output_tokens = flags.get("return_num_output_tokens", False)

    def text(self, out: RequestOutput) -> str:
        """The response text: the prompt goes before the first text of each choice when asked for."""
        if self.prefix and out.index not in self._prefixed:
            self._prefixed.add(out.index)
            return self.prefix + out.text
        return out.text

    def extra_outputs(self, out: RequestOutput) -> dict[str, np.ndarray]:
        """The vLLM backend's optional output tensors this request asked for."""
        extra: dict[str, np.ndarray] = {}
        if self.num_input_tokens:
            extra["num_input_tokens"] = np.array([out.prompt_tokens], dtype=np.uint32)
        if self.num_output_tokens:
            before = self._sent_tokens.get(out.index, 0)
            self._sent_tokens[out.index] = max(before, out.completion_tokens)
            extra["num_output_tokens"] = np.array([max(0, out.completion_tokens - before)], dtype=np.uint32)
        return extra
