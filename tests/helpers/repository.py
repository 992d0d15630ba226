"""Model repositories for the e2e tests that need a stack of their own: the served SmolLM2 folder alone, with some
of its profile parameters changed where a test needs it (the checked-in repository is never edited)."""

from __future__ import annotations

import shutil
from pathlib import Path

from bench.peer_runs import with_parameter
from devstack.triton import REPO_ROOT

SMOLLM2 = "smollm2_135m_instruct"  # its folder in model_repository/, and its name in Triton


def smollm2_only(root: Path, **parameters: str) -> Path:
    """`root`/repository serving SmolLM2 alone: a copy of its folder (a few kilobytes; the weights live in the model
    cache), with `parameters` set in its config.pbtxt."""
    repo = root / "repository"
    folder = repo / SMOLLM2
    shutil.copytree(REPO_ROOT / "model_repository" / SMOLLM2, folder, ignore=shutil.ignore_patterns("__pycache__"))
    config = folder / "config.pbtxt"
    text = config.read_text()
    for key, value in parameters.items():
        text = with_parameter(text, key, value)
    config.write_text(text)
    return repo
