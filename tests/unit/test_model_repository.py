"""Every served model folder speaks the same Triton tensor contract and names the engine's real entry point.

A model folder is made by copying another: this catches a copy that missed a later contract change (an input
added to one model only) or an import path that moved.
"""

from __future__ import annotations

import ast
import importlib
import re
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
MODELS = sorted(p.parent for p in (REPO / "model_repository").glob("*/config.pbtxt"))


def tensors(config: Path) -> tuple[list[str], list[str]]:
    text = re.sub(r"#[^\n]*", "", config.read_text())
    blocks = {name: re.search(rf"\n{name} \[(.*?)\n\]", text, re.S) for name in ("input", "output")}
    return tuple(re.findall(r"\{[^}]*\}", " ".join(blocks[n].group(1).split())) for n in ("input", "output"))


def test_every_model_declares_the_same_inputs_and_outputs():
    assert len(MODELS) >= 3
    first, *rest = MODELS
    for model in rest:
        assert tensors(model / "config.pbtxt") == tensors(first / "config.pbtxt"), model.name


@pytest.mark.parametrize("model", MODELS, ids=lambda p: p.name)
def test_model_py_imports_the_engines_triton_model(model):
    imports = [node for node in ast.walk(ast.parse((model / "1" / "model.py").read_text()))
               if isinstance(node, ast.ImportFrom) and any(a.name == "TritonPythonModel" for a in node.names)]
    (found,) = imports
    assert importlib.util.find_spec(found.module) is not None, found.module
