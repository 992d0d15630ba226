"""SmolLM2-135M-Instruct: the generation engine, configured by ../config.pbtxt parameters."""

import os
import site

# The backend stub embeds libpython in isolated mode (PYTHONPATH is ignored); the local dev stack
# names its venv and repo here. In the NGC image `engine` is installed system-wide and this is empty.
for _path in filter(None, os.environ.get("SIE_PYTHONPATH", "").split(os.pathsep)):
    site.addsitedir(_path)

from engine.triton_model import TritonPythonModel  # noqa: E402,F401  (the backend looks this name up)
