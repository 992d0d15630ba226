"""The `lora_control` request of the engine's Triton glue (engine/triton/lora_control.py), with stand-ins for the
backend and the engine: malformed control JSON is a 400 naming the input, an engine refusal comes back as the
request's error, and a success is one FINAL response whose extras list the adapters served after."""

from __future__ import annotations

import json
import threading
from types import SimpleNamespace

import pytest

from engine.errors import EngineError
from engine.triton import lora_control


class Lora:
    def __init__(self) -> None:
        self.served = ["pirate"]

    def load(self, name: str, path: str) -> list[str]:
        if not path.startswith("/cache/"):
            raise EngineError("invalid_request", "not resolved", "lora_path")
        self.served = sorted({*self.served, name})
        return self.served

    def unload(self, name: str) -> list[str]:
        raise EngineError("lora_adapter_in_use", f"'{name}' is in use", "lora_name")

    def names(self) -> list[str]:
        return self.served


class Sender:
    def __init__(self) -> None:
        self.sent: list[tuple[object, int]] = []
        self.done = threading.Event()

    def send(self, response, flags: int) -> None:
        self.sent.append((response, flags))
        self.done.set()


PB = SimpleNamespace(InferenceResponse=lambda output_tensors: {t.name: t.value for t in output_tensors},
                     Tensor=lambda name, value: SimpleNamespace(name=name, value=value),
                     TRITONSERVER_RESPONSE_COMPLETE_FINAL=1)


@pytest.mark.parametrize(("raw", "param"), [("{", "lora_control"), ('{"action": "evict"}', "lora_control"),
                                            ('{"action": "load", "lora_name": 3}', "lora_name")])
def test_malformed_control_is_a_400_naming_the_field(raw, param):
    with pytest.raises(EngineError) as info:
        lora_control.parse(raw)
    assert (info.value.code, info.value.param) == ("invalid_request", param)


def _answer(control: dict) -> tuple[Sender, list[EngineError]]:
    engine, sender, failed = SimpleNamespace(lora=Lora()), Sender(), []

    def fail(error: EngineError) -> None:
        failed.append(error)
        sender.done.set()

    lora_control.answer(PB, engine, json.dumps(control), sender, fail, lambda p: f"/cache/{p}")
    assert sender.done.wait(10)
    return sender, failed


def test_a_load_answers_once_final_with_the_adapters_served_after():
    sender, failed = _answer({"action": "load", "lora_name": "corsair", "lora_path": "corsair-folder"})
    assert failed == []
    ((response, flags),) = sender.sent
    assert flags == 1 and response["is_final"][0]
    assert json.loads(response["extras"][0]) == {"lora_adapters": ["corsair", "pirate"]}


def test_an_engine_refusal_is_the_requests_error():
    sender, failed = _answer({"action": "unload", "lora_name": "pirate"})
    assert sender.sent == [] and [(e.code, e.param) for e in failed] == [("lora_adapter_in_use", "lora_name")]
