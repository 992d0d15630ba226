"""The real `sie-sdk` 0.10.1 client against the real stack.

The SDK needs Python >= 3.12 and the project runs on 3.11, so the SDK gets its own venv
(`.venv-sdk`, created once by the `sdk_python` fixture and reused) and is driven through
`tests/e2e/sdk_driver.py`, whose JSON output the tests assert on.
"""

from __future__ import annotations

import glob
import json
import os
import re
import shutil
import subprocess
from pathlib import Path

import pytest

from tests.e2e.conftest import MODEL

REPO_ROOT = Path(__file__).resolve().parents[2]
SDK_VENV = REPO_ROOT / ".venv-sdk"
SDK_REQUIREMENT = "sie-sdk==0.10.1"
DRIVER = Path(__file__).with_name("sdk_driver.py")


def _works(python: str | Path, code: str) -> bool:
    try:
        return subprocess.run([str(python), "-c", code], check=False, capture_output=True, timeout=60).returncode == 0
    except (OSError, subprocess.TimeoutExpired):
        return False


def _find_python312() -> str | None:
    """python3.12 on PATH (a pyenv shim may exist without being active), else a pyenv install."""
    candidates = [shutil.which("python3.12"), shutil.which("python3.13")]
    pyenv_root = os.environ.get("PYENV_ROOT", os.path.expanduser("~/.pyenv"))
    candidates += sorted(glob.glob(f"{pyenv_root}/versions/3.1[2-9]*/bin/python3"))
    for candidate in candidates:
        if candidate and _works(candidate, "import sys; assert sys.version_info >= (3, 12)"):
            return candidate
    return None


@pytest.fixture(scope="session")
def sdk_python() -> Path:
    """`.venv-sdk/bin/python` with sie-sdk 0.10.1 installed (created on first use, then reused)."""
    python = SDK_VENV / "bin" / "python"
    check = "import sie_sdk, importlib.metadata as m; assert m.version('sie-sdk') == '0.10.1'"
    if _works(python, check):
        return python
    base = _find_python312()
    if base is None:
        pytest.skip("sie-sdk 0.10.1 needs Python >= 3.12 and none was found (python3.12 / pyenv)")
    shutil.rmtree(SDK_VENV, ignore_errors=True)
    steps = [[base, "-m", "venv", str(SDK_VENV)], [str(python), "-m", "pip", "install", "-q", SDK_REQUIREMENT]]
    for step in steps:
        done = subprocess.run(step, check=False, capture_output=True, text=True, timeout=600)
        if done.returncode != 0:
            pytest.skip(f"could not install {SDK_REQUIREMENT} into {SDK_VENV}: {done.stderr.strip()[-800:]}")
    if not _works(python, check):
        pytest.skip(f"{SDK_REQUIREMENT} installed but `import sie_sdk` fails in {SDK_VENV}")
    return python


@pytest.fixture(scope="module")
def sdk(sdk_python, stack):
    """Run one driver scenario against the stack and return its JSON."""

    def run(scenario: str, base_url: str | None = None) -> dict:
        done = subprocess.run(
            [str(sdk_python), str(DRIVER), scenario, base_url or stack.base_url, MODEL],
            check=False, capture_output=True, text=True, timeout=300,
            env={**os.environ, "NO_PROXY": "127.0.0.1,localhost", "no_proxy": "127.0.0.1,localhost"},
        )
        assert done.returncode == 0, f"driver failed ({done.returncode}):\n{done.stderr[-3000:]}"
        return json.loads(done.stdout.strip().splitlines()[-1])

    return run


def _ok(out: dict) -> dict:
    assert out["ok"], out.get("error")
    return out


def test_generate(sdk):
    out = _ok(sdk("generate"))
    result = out["result"]
    assert result["model"] == MODEL
    assert "Paris" in result["text"]
    assert result["finish_reason"] in ("stop", "length")
    usage = result["usage"]
    assert usage["prompt_tokens"] > 0 and usage["completion_tokens"] > 0
    assert usage["total_tokens"] == usage["prompt_tokens"] + usage["completion_tokens"]
    assert result["attempt_id"] and result["ttft_ms"] > 0
    assert result["request"]["id"]  # from X-SIE-Request-ID
    assert out["retries"] == 0
    assert re.fullmatch(r"[0-9a-f]{64}", out["revision"])  # X-SIE-Model-Revision: the served config's SHA-256


def test_stream_generate_with_logprobs(sdk):
    chunks = _ok(sdk("stream_generate"))["chunks"]
    assert len(chunks) >= 2
    deltas, final = chunks[:-1], chunks[-1]
    assert all(c["done"] is False for c in deltas)
    assert final["done"] is True and final["finish_reason"] == "length"
    assert final["usage"]["completion_tokens"] == 6
    assert "Paris" in "".join(c["text_delta"] for c in chunks)
    assert [c["seq"] for c in chunks] == list(range(len(chunks)))
    assert len({c["request_id"] for c in chunks}) == 1
    entries = [lp for c in deltas for lp in c.get("logprobs") or []]
    assert len(entries) == 6
    for entry in entries:
        assert isinstance(entry["token"], str) and entry["logprob"] <= 0
        assert len(entry["top_logprobs"]) == 2
        assert all(isinstance(t["token"], str) for t in entry["top_logprobs"])


def test_chat_completions(sdk):
    result = _ok(sdk("chat_completions"))["result"]
    assert result["object"] == "chat.completion" and result["model"] == MODEL
    choice = result["choices"][0]
    assert choice["message"]["role"] == "assistant"
    assert "Paris" in choice["message"]["content"]
    assert result["usage"]["completion_tokens"] > 0
    assert result["request"]["id"]


def test_stream_chat_completions(sdk):
    chunks = _ok(sdk("stream_chat_completions"))["chunks"]
    assert all(c["object"] == "chat.completion.chunk" for c in chunks)
    with_choices = [c for c in chunks if c["choices"]]
    assert with_choices[0]["choices"][0]["delta"].get("role") == "assistant"
    assert "Paris" in "".join(c["choices"][0]["delta"].get("content") or "" for c in with_choices)
    assert with_choices[-1]["choices"][0]["finish_reason"] in ("stop", "length")
    usage_chunk = chunks[-1]
    assert usage_chunk["choices"] == [] and usage_chunk["usage"]["completion_tokens"] > 0


@pytest.mark.parametrize("scenario", ["error_temperature", "error_temperature_chat", "error_temperature_stream"])
def test_validation_error_carries_code_and_param(sdk, scenario):
    out = sdk(scenario)
    assert not out["ok"]
    error = out["error"]
    assert error["class"] == "RequestError"
    assert error["status_code"] == 400
    assert error["code"] == "invalid_request"
    assert error["param"] == "temperature"


@pytest.mark.parametrize("scenario", ["error_unknown_model", "error_unknown_model_chat"])
def test_unknown_model_is_model_not_found(sdk, scenario):
    error = sdk(scenario)["error"]
    assert error["class"] == "RequestError"
    assert error["status_code"] == 404
    assert error["code"] == "model_not_found"
    assert error["param"] == "model"
    assert "no-such-model" in error["message"]


def test_output_cap_is_context_exceeded(sdk):
    error = sdk("error_context_exceeded")["error"]
    assert (error["class"], error["status_code"], error["code"], error["param"]) == \
        ("RequestError", 400, "context_exceeded", "max_new_tokens")


def test_sdk_retries_503_model_loading(sdk):
    """A proxy in front of the gateway answers the first request 503 MODEL_LOADING; the SDK retries."""
    out = sdk("retry_model_loading")
    for name in ("generate", "stream_generate", "chat_completions"):
        call = out[name]
        assert call["ok"], (name, call)
        assert call["retries"] == 1, (name, call)
        assert [s["status"] for s in call["seen"]] == [503, 200], (name, call)
    assert "Paris" in out["generate"]["result"]["text"]
    assert out["stream_generate"]["chunks"][-1]["done"] is True
    assert "Paris" in out["chat_completions"]["result"]["choices"][0]["message"]["content"]


def test_watch_reads_the_cluster_status_feed(sdk):
    """`client.watch()` asks /health whether this is a gateway, then reads /ws/cluster-status."""
    first, second = _ok(sdk("watch"))["messages"]
    for message in (first, second):
        assert message["type"] == "gateway" and message["status"] == "healthy"
        assert message["cluster"]["worker_count"] == 1 and message["cluster"]["models_loaded"] >= 1
        assert MODEL in message["workers"][0]["loaded_models"]
        assert MODEL in [m["name"] for m in message["models"] if m["state"] == "loaded"]
    assert 0.5 < second["timestamp"] - first["timestamp"] < 5  # pushed about once a second


def test_get_capacity_filters_workers_by_gpu(sdk):
    out = _ok(sdk("capacity"))
    everything, default, l4 = out["all"], out["default"], out["l4"]
    assert everything["status"] == "healthy" and everything["worker_count"] == 1
    assert everything["configured_gpu_types"] == everything["live_gpu_types"] == ["default"]
    assert default["worker_count"] == 1
    (worker,) = default["workers"]
    assert worker["gpu"] == "default" and worker["healthy"] is True and MODEL in worker["loaded_models"]
    assert worker["ready_gpu_slots"] == 1  # what the SDK derives for a healthy worker that states no GPU count
    assert l4["worker_count"] == 0 and l4["workers"] == []


def test_list_models_and_get_model(sdk):
    """`list_models()` reads the listing's `models`; `get_model()` the model object, as the SDK's ModelInfo."""
    out = _ok(sdk("models"))
    listed = {m["name"]: m for m in out["listed"]}
    assert listed[MODEL]["loaded"] is True and listed[MODEL]["state"] == "loaded"
    assert listed[MODEL]["inputs"] == ["text"] and listed[MODEL]["outputs"] == ["text"]
    assert listed[MODEL]["max_sequence_length"] > 0
    model = out["model"]
    assert model["name"] == model["id"] == MODEL
    assert "json_schema" in model["capabilities"]["grammar"]
    assert re.fullmatch(r"[0-9a-f]{64}", model["revision"])


def test_responses(sdk):
    result = _ok(sdk("responses"))["result"]
    assert result["object"] == "response" and result["status"] == "completed" and result["model"] == MODEL
    (message,) = result["output"]
    assert message["role"] == "assistant" and "Paris" in message["content"][0]["text"]
    assert 0 < result["usage"]["output_tokens"] <= 8 and result["request"]["id"]
