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
    """The contract's figures (docs/contract.md, "Capacity and routing errors"): these must not drift when the
    table is edited."""
    assert (lookup("QUEUE_FULL").http, lookup("QUEUE_FULL").retry_after) == (503, 1)
    assert (lookup("MODEL_LOADING").http, lookup("MODEL_LOADING").retry_after) == (503, 5)
    assert lookup("context_exceeded") == ("INVALID_ARG", 400, "context_length_exceeded", None)
    assert lookup("cancelled").triton == "CANCELLED"


def test_unknown_codes_are_inference_errors():
    err = worker_error("kaboom", "engine crashed")
    assert (err.status, err.code, err.retry_after) == (500, UNKNOWN_CODE, None)
    assert lookup("kaboom").triton == "INTERNAL"
    assert worker_error("malformed_worker_response", "x").code == "malformed_worker_response"


def engine_error_codes() -> dict[str, list[str]]:
    """Every code the engine raises, by a literal `EngineError("code"` or an EngineError subclass's
    `super().__init__("code"` anywhere under engine/, with the files that raise it."""
    found: dict[str, list[str]] = {}
    for path in sorted((REPO / "engine").rglob("*.py")):
        text = path.read_text()
        for code in re.findall(r'(?:EngineError|super\(\)\.__init__)\(\s*"([A-Za-z_]+)"', text):
            found.setdefault(code, []).append(str(path.relative_to(REPO)))
    return found


def test_the_scan_reaches_every_engine_package():
    """The scan recurses: codes raised in engine/core/, engine/sampling/ and engine/inputs/ are found too."""
    found = engine_error_codes()
    folders = {f.split("/")[1] for files in found.values() for f in files}
    assert {"core", "sampling", "inputs", "triton"} <= folders, folders
    assert {"context_exceeded", "grammar_invalid", "unknown_lora_adapter", "QUEUE_FULL", "cancelled"} <= set(found)


def test_every_code_the_engine_raises_is_in_the_table():
    """A code missing here would reach clients as a 500 inference_error."""
    found = engine_error_codes()
    assert found, "the scan found no engine error codes"
    missing = {code: files for code, files in found.items() if code not in ERROR_CODES and code != UNKNOWN_CODE}
    assert missing == {}


def test_the_contract_doc_lists_every_code():
    doc = (REPO / "docs" / "triton-contract.md").read_text()
    missing = [code for code in ERROR_CODES if f"`{code}`" not in doc]
    assert missing == []
