"""Suite-wide rules. Under `CI=true` a skipped test is a failed test, except where the machine lacks a CPU feature
or llm-d's endpoint picker binary.

A skip for a missing model, a pinned dependency that does not import or a missing Python interpreter means the
install is broken, and a broken install must not pass CI by skipping whatever it could not run. Only a skip whose
reason names a CPU feature this machine lacks stays a skip (no install step can add an instruction set), and the one
test that needs an `epp` binary, which cannot be built where the Go module proxy is out of reach.
"""

from __future__ import annotations

import os
import re
from collections.abc import Generator

import pytest

# The allow-list: skips that stay skips under CI=true. Each such test says in its reason that it runs only
# "where the CPU has" a feature (AVX512_BF16, native bf16, AMX, AVX-512), or that llm-d's endpoint picker is
# missing: it is a Go binary whose modules these machines cannot fetch, so no install step can add it either. Add a
# phrase here only for such a reason.
CPU_FEATURE_SKIP = re.compile(r"where the CPU has (AVX512_BF16|native bf16|AMX|AVX-512)", re.IGNORECASE)
EPP_SKIP = re.compile(r"no `epp` binary on PATH")


def _in_ci() -> bool:
    return os.environ.get("CI", "").strip().lower() in ("1", "true", "yes")


def skip_reason(longrepr: object) -> str:
    """The message of a skip report (pytest keeps it as (path, line, "Skipped: reason"))."""
    if isinstance(longrepr, tuple) and len(longrepr) == 3:
        return str(longrepr[2])
    return str(longrepr)


def skip_is_allowed(reason: str) -> bool:
    return bool(CPU_FEATURE_SKIP.search(reason) or EPP_SKIP.search(reason))


def _fail_skip(report: pytest.TestReport | pytest.CollectReport) -> None:
    reason = skip_reason(report.longrepr)
    if skip_is_allowed(reason):
        return
    report.outcome = "failed"
    report.longrepr = (f"skipped under CI=true, which counts as a failure (only a missing CPU feature or `epp` binary "
                       f"may skip; tests/conftest.py): {reason}")


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[None]) -> Generator[None, None, None]:
    outcome = yield
    report: pytest.TestReport = outcome.get_result()
    if _in_ci() and report.skipped and not hasattr(report, "wasxfail"):
        _fail_skip(report)


_COLLECTION_SKIPS: list[str] = []


@pytest.hookimpl(hookwrapper=True)
def pytest_make_collect_report(collector: pytest.Collector) -> Generator[None, None, None]:
    # A module-level importorskip or skip skips a whole file while it is collected. Failing the collection would
    # abort the run before any test; so the file is noted here and the session fails at its end instead.
    outcome = yield
    report: pytest.CollectReport = outcome.get_result()
    if _in_ci() and report.skipped:
        reason = skip_reason(report.longrepr)
        if not skip_is_allowed(reason):
            _COLLECTION_SKIPS.append(f"{report.nodeid}: {reason}")


_LAYER_SECONDS: dict[str, float] = {}  # tests/<layer>/...: setup, call and teardown seconds (README, Testing)


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    parts = report.nodeid.split("/")
    layer = parts[1] if len(parts) > 2 and parts[0] == "tests" else "other"
    _LAYER_SECONDS[layer] = _LAYER_SECONDS.get(layer, 0.0) + report.duration


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter) -> None:
    if _LAYER_SECONDS:
        terminalreporter.write_line("time per layer: " + ", ".join(
            f"{layer} {seconds:.0f} s" for layer, seconds in sorted(_LAYER_SECONDS.items(), key=lambda kv: -kv[1])))
    if _COLLECTION_SKIPS:
        terminalreporter.section("files skipped under CI=true (a failure: tests/conftest.py)", red=True)
        for line in _COLLECTION_SKIPS:
            terminalreporter.line(line)


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    if _COLLECTION_SKIPS and exitstatus in (pytest.ExitCode.OK, pytest.ExitCode.NO_TESTS_COLLECTED):
        session.exitstatus = pytest.ExitCode.TESTS_FAILED
