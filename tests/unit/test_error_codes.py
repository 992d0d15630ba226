"""The one error table (contract/error_codes.py) read by both sides of the Triton contract."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

from contract.error_codes import ERROR_CODES, UNKNOWN_CODE, lookup
from gateway.errors import worker_error

REPO = Path(__file__).resolve().parents[2]
# the status names `triton_python_backend_utils.TritonError` defines
TRITON_STATUSES = {"UNKNOWN", "INTERNAL", "NOT_FOUND", "INVALID_ARG", "UNAVAILABLE", "UNSUPPORTED", "ALREADY_EXISTS",
                   "CANCELLED"}


def test_gateway_reads_the_table_without_torch():
    code = "import sys, gateway.errors; bad = {'torch', 'numpy', 'transformers'} & set(sys.modules); print(sorted(bad))"
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


@pytest.mark.parametrize("code", sorted(ERROR_CODES))
def test_gateway_answers_each_code_from_the_table(code):
    entry = ERROR_CODES[code]
    assert entry.triton in TRITON_STATUSES
    err = worker_error(code, "said no", param="p")
    assert (err.status, err.code, err.type, err.param) == (entry.http, code, entry.type, "p")
    headers = err.headers()
    assert headers["X-SIE-Error-Code"] == code
    assert headers.get("Retry-After") == (None if entry.retry_after is None else f"{entry.retry_after:g}")
    assert err.body()["error"]["code"] == code


def test_known_retry_and_status_values():
    """The contract's figures (sie-contract.md 2.4): these must not drift when the table is edited."""
    assert (lookup("QUEUE_FULL").http, lookup("QUEUE_FULL").retry_after) == (503, 1)
    assert (lookup("MODEL_LOADING").http, lookup("MODEL_LOADING").retry_after) == (503, 5)
    assert lookup("context_exceeded") == ("INVALID_ARG", 400, "context_length_exceeded", None)
    assert lookup("cancelled").triton == "CANCELLED"


def test_unknown_codes_are_inference_errors():
    err = worker_error("kaboom", "engine crashed")
    assert (err.status, err.code, err.retry_after) == (500, UNKNOWN_CODE, None)
    assert lookup("kaboom").triton == "INTERNAL"
    assert worker_error("malformed_worker_response", "x").code == "malformed_worker_response"


def test_every_code_the_engine_raises_is_in_the_table():
    """A code missing here would reach clients as a 500 inference_error."""
    source = "\n".join(p.read_text() for p in (REPO / "engine").glob("*.py"))
    raised = set(re.findall(r'EngineError\(\s*"([A-Za-z_]+)"', source))
    assert raised, "the scan found no engine error codes"
    assert raised - set(ERROR_CODES) <= {UNKNOWN_CODE}


def test_the_contract_doc_lists_every_code():
    doc = (REPO / "docs" / "triton-contract.md").read_text()
    missing = [code for code in ERROR_CODES if f"`{code}`" not in doc]
    assert missing == []
