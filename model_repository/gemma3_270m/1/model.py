"""Gemma 3 270M: the generation engine, configured by ../config.pbtxt parameters."""

import os
import site
import sys

# The backend stub embeds libpython in isolated mode (PYTHONPATH is ignored) with the base
# interpreter's site-packages on sys.path. The local dev stack names its venv and the repo in
# SIE_PYTHONPATH; they must come *first*, or e.g. the base numpy 2.x shadows the venv's 1.x and
# the stub's tensors come out garbled. In the NGC image this variable is unset: a no-op.
_paths = [p for p in os.environ.get("SIE_PYTHONPATH", "").split(os.pathsep) if p]
if _paths:
    _before = list(sys.path)
    for _path in _paths:
        site.addsitedir(_path)
    sys.path[:] = [p for p in sys.path if p not in _before] + _before

from engine.triton.model import TritonPythonModel  # noqa: E402,F401  (the backend looks this name up)
