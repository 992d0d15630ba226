"""Run-time LoRA on the real stack (docs/lora.md): SmolLM2 behind a gateway with SIE_ALLOW_RUNTIME_LORA_UPDATING=1.

The demo adapter (scripts/make_lora.py), served from the profile as `pirate`, is loaded again at run time as
`corsair`: it is listed at once, answers like `pirate` both as the `model` and as `lora_adapter`, and once unloaded it
is gone from the list and using it is an error in the contract's envelope."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest

from devstack.stack import LocalStack, local_stack
from tests.helpers.repository import smollm2_only

from .conftest import MODEL

QUESTION = [{"role": "user", "content": "What is the capital of France?"}]


@pytest.fixture(scope="module")
def lora_stack(tmp_path_factory) -> Iterator[LocalStack]:
    root = tmp_path_factory.mktemp("runtime-lora")
    repo = smollm2_only(root)
    env = {"SIE_AUTH_MODE": "none", "SIE_ALLOW_RUNTIME_LORA_UPDATING": "1"}
    with local_stack(repo, Path(root), extra_env=env) as stack:
        yield stack


@pytest.fixture(scope="module")
def client(lora_stack: LocalStack) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{lora_stack.base_url}/v1", api_key="none", max_retries=0)


def _answer(client: openai.OpenAI, model: str = MODEL, **extra_body) -> str:
    reply = client.chat.completions.create(model=model, messages=QUESTION, max_tokens=16, temperature=0,
                                           extra_body=extra_body or None)
    return reply.choices[0].message.content or ""


def _ids(client: openai.OpenAI) -> set[str]:
    return {m.id for m in client.models.list().data}


def test_load_list_use_unload(lora_stack: LocalStack, client: openai.OpenAI):
    base_url = lora_stack.base_url
    assert {MODEL, "pirate"} <= _ids(client) and "corsair" not in _ids(client)
    pirate = _answer(client, lora_adapter="pirate")
    assert pirate != _answer(client)

    bad = httpx.post(f"{base_url}/v1/load_lora_adapter", json={"lora_name": "x", "lora_path": "/no/such/adapter"},
                     timeout=120)
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "lora_path"

    loaded = httpx.post(f"{base_url}/v1/load_lora_adapter",
                        json={"lora_name": "corsair", "lora_path": "smollm2-lora-pirate"}, timeout=300)
    assert loaded.status_code == 200, loaded.text
    assert "corsair" in _ids(client)
    assert _answer(client, model="corsair") == pirate
    assert _answer(client, lora_adapter="corsair") == pirate

    unloaded = httpx.post(f"{base_url}/v1/unload_lora_adapter", json={"lora_name": "corsair"}, timeout=120)
    assert unloaded.status_code == 200, unloaded.text
    assert "corsair" not in _ids(client)
    with pytest.raises(openai.NotFoundError):
        _answer(client, model="corsair")
    with pytest.raises(openai.BadRequestError) as info:
        _answer(client, lora_adapter="corsair")
    assert info.value.code == "unknown_lora_adapter" and info.value.param == "lora_adapter"
