"""Your own model, served: every tiny architecture (tests/tiny_architectures.py) through devstack.add_model and one
real tritonserver + gateway, driven by the openai SDK.

Each served model answers a greedy completion with exactly HF `generate`'s text; a chat renders its template; the one
model written without a chat template answers chat with a 400 naming `messages` while its completions work; the
refused model is UNAVAILABLE in Triton with the feature named, and absent from /v1/models, while the rest serve.
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Iterator

import httpx
import pytest

from devstack.add_model import add_model
from devstack.stack import LocalStack, local_stack
from tests.tiny_architectures import EOS, REFUSED, SERVED, TOKENIZER_DIR, ensure_tiny_model, hf_greedy

PROMPT = "The capital of France is"
NEW_TOKENS = 12
NO_TEMPLATE = "opt"  # written without a chat template: a base model's profile
REFUSED_HERE = next(a for a in REFUSED if a.name == "mamba")


def served_name(name: str) -> str:
    return f"sie-test/tiny-{name}"  # the config's _name_or_path (tests/tiny_architectures.py)


@pytest.fixture(scope="module")
def own_stack(tmp_path_factory) -> Iterator[LocalStack]:
    if not (TOKENIZER_DIR / "tokenizer.json").exists():
        pytest.skip(f"the SmolLM2 tokenizer is not prepared at {TOKENIZER_DIR} (run `make model`)")
    root = tmp_path_factory.mktemp("own-models")
    repo, logs = root / "repository", root / "logs"
    logs.mkdir()
    for arch in [*SERVED, REFUSED_HERE]:
        folder = ensure_tiny_model(arch, root / "models")
        if arch.name == NO_TEMPLATE:
            (folder / "chat_template.jinja").unlink(missing_ok=True)
        add_model(folder, repo, kv_memory_bytes=64 << 20)
    with local_stack(repo, logs, workers=1, extra_env={"SIE_AUTH_MODE": "none"}, keep_serving=True) as running:
        yield running
    shutil.rmtree(root / "models", ignore_errors=True)


@pytest.fixture(scope="module")
def client(own_stack: LocalStack):
    import openai

    return openai.OpenAI(base_url=own_stack.base_url + "/v1", api_key="unused", max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def references(own_stack: LocalStack) -> dict[str, str]:
    """HF `generate`'s greedy text for PROMPT on each served folder (the turn end ends it, as it ends ours)."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(TOKENIZER_DIR)
    out = {}
    for arch in SERVED:
        (ids,) = hf_greedy(own_stack.log_dir.parent / "models" / arch.name, [PROMPT], NEW_TOKENS)
        out[arch.name] = tokenizer.decode([t for t in ids if t != EOS])
    return out


def test_every_served_architecture_is_listed_and_the_refused_one_is_not(client):
    listed = {m.id for m in client.models.list().data}
    assert {served_name(a.name) for a in SERVED} <= listed
    assert served_name(REFUSED_HERE.name) not in listed


def test_the_refused_model_is_unavailable_in_triton_naming_the_feature(own_stack):
    states = {m.name: m for m in own_stack.models or []}
    refused = states["sie_test_tiny_mamba"]
    assert refused.state == "UNAVAILABLE" and "state-space or recurrent layers (MambaMixer)" in refused.reason
    assert all(m.state == "READY" for name, m in states.items() if name != refused.name)


@pytest.mark.parametrize("arch", SERVED, ids=[a.name for a in SERVED])
def test_greedy_completion_equals_hf_generate(client, references, arch):
    done = client.completions.create(model=served_name(arch.name), prompt=PROMPT, max_tokens=NEW_TOKENS,
                                     temperature=0)
    assert done.choices[0].text == references[arch.name]
    assert done.usage.completion_tokens > 0


@pytest.mark.parametrize("arch", [a for a in SERVED if a.name != NO_TEMPLATE][:3], ids=lambda a: a.name)
def test_chat_renders_the_folders_template(client, arch):
    done = client.chat.completions.create(model=served_name(arch.name), max_tokens=4, temperature=0,
                                          messages=[{"role": "user", "content": "Hi"}])
    # ChatML: <|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n is 9 tokens; "Hi" alone is 1
    assert done.usage.prompt_tokens >= 9 and done.choices[0].finish_reason in ("stop", "length")


def test_a_model_without_a_chat_template_answers_chat_with_400_naming_messages(own_stack, client):
    r = httpx.post(f"{own_stack.base_url}/v1/chat/completions", timeout=60,
                   json={"model": served_name(NO_TEMPLATE), "max_tokens": 4,
                         "messages": [{"role": "user", "content": "Hi"}]})
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == "messages" and "no chat template" in error["message"], json.dumps(error)
    done = client.completions.create(model=served_name(NO_TEMPLATE), prompt=PROMPT, max_tokens=4, temperature=0)
    assert done.usage.completion_tokens > 0
