"""The `lora_control` request (docs/triton-contract.md): load, unload or list the model's LoRA adapters at run time.

The gateway's /v1/load_lora_adapter and /v1/unload_lora_adapter send one to every endpoint serving the model, and its
model discovery a `list`. The answer is one FINAL response whose `extras` is `{"lora_adapters": [names]}` (the
adapters served after the change), or an error response from the contract's table (400 naming `lora_name` /
`lora_path`, 409 lora_adapter_in_use / lora_capacity_exceeded). A load reads the adapter on a thread of its own, so
Triton's execute thread and the engine loop never wait on the disk; the table changes between engine steps.
"""

from __future__ import annotations

import json
import logging
import threading
from collections.abc import Callable
from typing import Any

import numpy as np

from engine.errors import EngineError

log = logging.getLogger(__name__)
INPUT = "lora_control"
ACTIONS = ("load", "unload", "list")


def parse(raw: str | None) -> dict[str, Any]:
    """The control JSON: {"action": load|unload|list, "lora_name", "lora_path"}."""
    try:
        control = json.loads(raw or "")
    except json.JSONDecodeError:
        raise EngineError("invalid_request", "lora_control is not JSON", INPUT) from None
    if not isinstance(control, dict) or control.get("action") not in ACTIONS:
        raise EngineError("invalid_request", f"lora_control.action must be one of {', '.join(ACTIONS)}", INPUT)
    for field in ("lora_name", "lora_path"):
        if not isinstance(control.get(field, ""), str):
            raise EngineError("invalid_request", f"{field} must be a string", field)
    return control


def run(engine, control: dict[str, Any], resolve_path: Callable[[str], str]) -> list[str]:
    """Apply one control request to the engine; returns the adapters it serves after."""
    action = control["action"]
    if action == "load":
        path = control.get("lora_path") or ""
        return engine.lora.load(control.get("lora_name") or "", resolve_path(path) if path else "")
    if action == "unload":
        return engine.lora.unload(control.get("lora_name") or "")
    return engine.lora.names()


def answer(pb_utils, engine, raw: str | None, sender, fail: Callable[[EngineError], None],
           resolve_path: Callable[[str], str]) -> None:
    """Parse now (a malformed request fails at once), then act and answer on a thread of its own."""
    control = parse(raw)

    def work() -> None:
        try:
            names = run(engine, control, resolve_path)
        except EngineError as exc:
            fail(exc)
            return
        except Exception as exc:  # a fault loading one adapter fails this request, never the model
            log.exception("lora_control %s failed", control["action"])
            fail(EngineError("inference_error", f"LoRA {control['action']} failed: {type(exc).__name__}"))
            return
        log.info("lora_control %s %s: serving %s", control["action"], control.get("lora_name", ""), names)
        sender.send(pb_utils.InferenceResponse(output_tensors=_tensors(pb_utils, names)),
                    flags=pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL)

    if control["action"] == "list":
        work()
    else:
        threading.Thread(target=work, name="lora-control", daemon=True).start()


def _tensors(pb_utils, names: list[str]) -> list[Any]:
    extras = json.dumps({"lora_adapters": names}).encode()
    return [
        pb_utils.Tensor("text_output", np.array([b""], dtype=np.object_)),
        pb_utils.Tensor("index", np.array([0], dtype=np.int32)),
        pb_utils.Tensor("finish_reason", np.array([b"stop"], dtype=np.object_)),
        pb_utils.Tensor("prompt_tokens", np.array([0], dtype=np.int32)),
        pb_utils.Tensor("completion_tokens", np.array([0], dtype=np.int32)),
        pb_utils.Tensor("logprobs", np.array([b""], dtype=np.object_)),
        pb_utils.Tensor("is_final", np.array([True], dtype=np.bool_)),
        pb_utils.Tensor("extras", np.array([extras], dtype=np.object_)),
    ]
