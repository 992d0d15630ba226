"""The engine's layering holds (tests/engine_layers.py): every import of engine/ and contract/ follows the table, the
torch-free modules stay torch-free, only engine.triton knows the Python backend, there is no import cycle, and the
gateway imports nothing from engine/ (nor torch). Reads the sources with ast; imports nothing it checks."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.engine_layers import (
    PENDING,
    REPO,
    TORCH,
    TRITON_STUB,
    Import,
    allowed,
    find_cycle,
    imports,
    modules,
    rule_of,
)

ENGINE = modules("contract", "engine")
OURS = ("engine", "contract")


def _ours(target: str) -> bool:
    return target.split(".")[0] in OURS


def _violations(known: dict[str, Path]) -> tuple[list[str], set[tuple[str, str]]]:
    """Each broken rule as 'file:line message', and the (module, target) pairs of broken directions."""
    found: list[str] = []
    edges: set[tuple[str, str]] = set()
    for module, path in known.items():
        where = module.replace(".", "/") + ("/__init__.py" if path.name == "__init__.py" else ".py")
        torch_free = rule_of(module)[1].torch_free
        for imp in imports(path, known):
            top = imp.target.split(".")[0]
            if top == TRITON_STUB and not module.startswith("engine.triton"):
                found.append(f"{where}:{imp.line} imports {TRITON_STUB} outside engine.triton")
            if torch_free and not imp.type_only:
                if top in TORCH:
                    found.append(f"{where}:{imp.line} is torch-free but imports {imp.target}")
                elif _ours(imp.target) and imp.target in known and not rule_of(imp.target)[1].torch_free:
                    found.append(f"{where}:{imp.line} is torch-free but imports {imp.target}, which is not")
            if _ours(imp.target) and not allowed(module, imp.target):
                edges.add((module, imp.target))
                if (module, imp.target) not in PENDING:
                    found.append(f"{where}:{imp.line} {module} may not import {imp.target} ({rule_of(module)[0]})")
    return found, edges


def test_every_engine_module_is_in_a_layer():
    for module in ENGINE:
        rule_of(module)  # KeyError names the module


def test_engine_imports_follow_the_table():
    found, edges = _violations(ENGINE)
    assert not found, "\n".join(found)
    gone = PENDING - edges
    assert not gone, f"no longer imported, drop from tests/engine_layers.py PENDING: {sorted(gone)}"


def test_no_import_cycle_in_the_engine():
    graph: dict[str, set[str]] = {m: set() for m in ENGINE}
    for module, path in ENGINE.items():
        for imp in imports(path, ENGINE):
            if imp.target in ENGINE and imp.target != module and (module, imp.target) not in PENDING:
                graph[module].add(imp.target)
    assert find_cycle(graph) is None, " -> ".join(find_cycle(graph) or [])


def test_the_gateway_imports_no_engine_and_no_torch():
    gateway = modules("gateway")
    bad = [f"{path.relative_to(REPO)}:{imp.line} {imp.target}" for path in gateway.values()
           for imp in imports(path, gateway) if imp.target.split(".")[0] in {"engine", *TORCH, "transformers"}]
    assert not bad, bad


def test_a_planted_upward_import_is_caught(tmp_path):
    """The check itself: the text layer importing the scheduler, and torch, is reported with its place."""
    planted = tmp_path / "engine" / "text" / "planted.py"
    planted.parent.mkdir(parents=True)
    planted.write_text("import json\nfrom engine.core.scheduler import Scheduler\nimport torch\n")
    found, _ = _violations({**ENGINE, "engine.text.planted": planted})
    found = [f for f in found if "planted" in f]
    assert found == ["engine/text/planted.py:2 is torch-free but imports engine.core.scheduler, which is not",
                     "engine/text/planted.py:2 engine.text.planted may not import engine.core.scheduler (engine.text)",
                     "engine/text/planted.py:3 is torch-free but imports torch"]


@pytest.mark.parametrize("target", ["engine.request", "engine.errors"])
def test_imports_reads_type_checking_blocks(tmp_path, target):
    src = tmp_path / "m.py"
    src.write_text(f"from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    import torch\n    import {target}\n")
    assert imports(src, ENGINE) == [Import("typing", 1, False), Import("torch", 3, True), Import(target, 4, True)]
