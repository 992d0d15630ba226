#!/usr/bin/env bash
# GuideLLM (the vLLM project's benchmark tool) in its own venv under .cache/ (gitignored), for the e2e test
# tests/e2e/test_guidellm.py and by hand: never part of the project's dependencies. Idempotent: a marker file
# records a finished install, so a second run does nothing.
set -euo pipefail

ROOT="$(cd "$(dirname "$0")/.." && pwd)"
VENV="${GUIDELLM_VENV:-$ROOT/.cache/guidellm/venv}"
PYTHON="${PYTHON:-python3.11}"
VERSION="${GUIDELLM_VERSION:-0.8.1}"
MARKER="$VENV/.installed-guidellm-$VERSION"

if [[ -f "$MARKER" ]]; then
    echo "guidellm $VERSION already installed in $VENV"
    exit 0
fi

mkdir -p "$(dirname "$VENV")"
[[ -x "$VENV/bin/python" ]] || "$PYTHON" -m venv "$VENV"
"$VENV/bin/python" -m pip install -q --upgrade pip
"$VENV/bin/python" -m pip install -q "guidellm==$VERSION"
"$VENV/bin/guidellm" --help >/dev/null  # a broken install fails here, not inside the test
touch "$MARKER"
echo "guidellm $VERSION installed in $VENV"
