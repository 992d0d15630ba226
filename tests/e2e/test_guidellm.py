"""GuideLLM (the vLLM project's benchmark tool), unmodified, against the real stack: its backend check
(`GET /health`) passes and a short concurrent run on /v1/completions has every request successful.

GuideLLM lives in its own venv under .cache/ (bench/install_guidellm.sh: `make tools`, which `make test` runs
first, or here when it is missing); it is never a project dependency. The run is short: 4 streams, 12 requests,
16 tokens out.
"""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest

from devstack.triton import REPO_ROOT
from tests.e2e.conftest import MODEL

VENV = Path(os.environ.get("GUIDELLM_VENV", REPO_ROOT / ".cache" / "guidellm" / "venv"))
REQUESTS = 12


@pytest.fixture(scope="module")
def guidellm() -> Path:
    exe = VENV / "bin" / "guidellm"
    if not list(VENV.glob(".installed-guidellm-*")):
        subprocess.run(["bash", str(REPO_ROOT / "bench" / "install_guidellm.sh")], check=True, timeout=1800,
                       env={**os.environ, "GUIDELLM_VENV": str(VENV)})
    return exe


def test_guidellm_concurrent_run_on_completions_all_successful(stack, guidellm, tmp_path):
    tokenizer = Path(os.environ.get("SIE_MODEL_CACHE", REPO_ROOT / ".cache" / "models")) / "SmolLM2-135M-Instruct"
    report_path = tmp_path / "benchmarks.json"
    cmd = [
        str(guidellm), "run",
        "--backend", f"kind=openai_http,target={stack.base_url},model={MODEL},request_format=/v1/completions",
        "--profile", "kind=concurrent,streams=4",
        "--constraint", f"kind=max_requests,count={REQUESTS}",
        "--data", "kind=synthetic_text,prompt_tokens=32,output_tokens=16",
        "--tokenizer", f"kind=huggingface_auto,model={tokenizer}",
        "--output", f"kind=json,path={report_path}",
        "--disable-console-interactive",
    ]
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
    run = subprocess.run(cmd, capture_output=True, text=True, timeout=600, env=env, cwd=tmp_path)
    assert run.returncode == 0, (run.stdout[-3000:], run.stderr[-3000:])
    (benchmark,) = json.loads(report_path.read_text())["benchmarks"]
    made = benchmark["scheduler_metrics"]["requests_made"]
    assert made == {"successful": REQUESTS, "errored": 0, "incomplete": 0, "total": REQUESTS}, run.stdout[-3000:]
    for request in benchmark["requests"]["successful"]:
        body = json.loads(request["request_args"])["body"]
        assert body["stream_options"] == {"include_usage": True, "continuous_usage_stats": True}
        assert request["output_tokens"] == 16  # ignore_eos: exactly the asked length, counted from our usage
