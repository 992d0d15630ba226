"""Under CI=true a skip fails the run unless the machine lacks a CPU feature (tests/conftest.py)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import skip_is_allowed

REPO = Path(__file__).resolve().parents[2]

SAMPLE = '''
import pytest

def test_missing_model():
    pytest.skip("model not prepared at /nowhere (run `make model`)")

@pytest.mark.skipif(True, reason="the bf16 attention kernel runs where the CPU has AVX512_BF16")
def test_cpu_feature():
    pass

def test_runs():
    pass
'''
IMPORT_SKIP = 'import pytest\nnot_installed = pytest.importorskip("no_such_pinned_dependency")\n'


def _run(tmp_path: Path, ci: str) -> subprocess.CompletedProcess[str]:
    (tmp_path / "conftest.py").write_text("from tests.conftest import *  # noqa: F403\n")
    (tmp_path / "test_sample.py").write_text(SAMPLE)
    (tmp_path / "test_import.py").write_text(IMPORT_SKIP)
    env = {**os.environ, "CI": ci, "PYTHONPATH": str(REPO)}
    return subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-rA", "--rootdir",
                           str(tmp_path), "-c", os.devnull, str(tmp_path)],
                          cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120)


def test_outside_ci_skips_stay_skips(tmp_path):
    done = _run(tmp_path, "")
    assert done.returncode == 0, done.stdout
    assert "1 passed, 3 skipped" in done.stdout


def test_under_ci_a_missing_model_or_dependency_fails_and_a_cpu_feature_still_skips(tmp_path):
    done = _run(tmp_path, "true")
    assert done.returncode == 1, done.stdout
    assert "FAILED" in done.stdout and "test_missing_model" in done.stdout
    assert "files skipped under CI=true" in done.stdout  # the module-level importorskip, at collection
    assert "test_import.py: Skipped: could not import 'no_such_pinned_dependency'" in done.stdout
    assert "1 failed, 1 passed, 2 skipped" in done.stdout  # every other test still ran
    assert "SKIPPED" in done.stdout and "AVX512_BF16" in done.stdout  # the allow-listed CPU feature


@pytest.mark.parametrize(("reason", "allowed"), [
    ("bf16 is served only where the CPU has native bf16 (avx512_bf16 or AMX)", True),
    ("bf16 weights run on our tiled kernel only where the CPU has AVX512_BF16", True),
    ("the bf16 tiled kernel runs where the CPU has AVX512_BF16", True),
    ("quantized weights run where the CPU has AVX-512 (our kernels)", True),
    ("our CPU kernels cannot be built here", False),  # a build failure is a failure
    ("model not prepared at .cache/models/SmolLM2-135M-Instruct (run `make model`)", False),
    ("sie-sdk 0.10.1 needs Python >= 3.12 and none was found (python3.12 / pyenv)", False),
    ("could not import 'schemathesis': No module named 'schemathesis'", False),
    ("llm-d's endpoint picker runs this test: no `epp` binary on PATH (build llm-d/llm-d-router ./cmd/epp)", True),
])
def test_the_allow_list_is_cpu_features_and_the_endpoint_picker(reason, allowed):
    assert skip_is_allowed(reason) is allowed
