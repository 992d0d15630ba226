"""A profile with an unknown key, on the real stack: Triton marks that model UNAVAILABLE with the key named (and the
closest known one), the gateway does not list it, and the model beside it serves (contract/profile.py)."""

from __future__ import annotations

from collections.abc import Iterator

import httpx
import pytest

from devstack.add_model import add_model
from devstack.stack import LocalStack, local_stack
from tests.tiny_architectures import SERVED, TOKENIZER_DIR, ensure_tiny_model

TYPO = 'parameters: { key: "max_slot", value: { string_value: "4" } }\n'


@pytest.fixture(scope="module")
def stack(tmp_path_factory) -> Iterator[LocalStack]:
    if not (TOKENIZER_DIR / "tokenizer.json").exists():
        pytest.skip(f"the SmolLM2 tokenizer is not prepared at {TOKENIZER_DIR} (run `make model`)")
    root = tmp_path_factory.mktemp("profile-refused")
    repo, logs = root / "repository", root / "logs"
    logs.mkdir()
    folder = ensure_tiny_model(SERVED[0], root / "models")
    add_model(folder, repo, name="sie-test/good", kv_memory_bytes=64 << 20)
    typo = add_model(folder, repo, name="sie-test/typo", kv_memory_bytes=64 << 20)
    config = typo / "config.pbtxt"
    config.write_text(config.read_text() + TYPO)
    with local_stack(repo, logs, workers=1, extra_env={"SIE_AUTH_MODE": "none"}, keep_serving=True) as running:
        yield running


def test_the_typo_model_is_unavailable_naming_the_key_and_the_other_serves(stack):
    states = {m.name: m for m in stack.models or []}
    assert states["sie_test_typo"].state == "UNAVAILABLE"
    assert "`max_slot`" in states["sie_test_typo"].reason and "`max_slots`" in states["sie_test_typo"].reason
    assert states["sie_test_good"].state == "READY"
    listed = {m["id"] for m in httpx.get(stack.base_url + "/v1/models", timeout=30).json()["data"]}
    assert "sie-test/good" in listed and "sie-test/typo" not in listed
    done = httpx.post(stack.base_url + "/v1/completions", timeout=120,
                      json={"model": "sie-test/good", "prompt": "Hi", "max_tokens": 2})
    assert done.status_code == 200, done.text
