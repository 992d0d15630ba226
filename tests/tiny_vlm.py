"""The tiny random-weight vision-language test model (scripts/make_vision_model.py), built on first use."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
CACHE = Path(os.environ.get("SIE_MODEL_CACHE") or REPO / ".cache" / "models")
VLM_DIR = CACHE / "tiny-llava"
TOKENIZER_DIR = CACHE / "SmolLM2-135M-Instruct"


def ensure_tiny_vlm() -> Path | None:
    """The model folder (built now if missing: a few seconds, no download); None without the SmolLM2 tokenizer."""
    if (VLM_DIR / ".complete").exists():
        return VLM_DIR
    if not (TOKENIZER_DIR / "tokenizer.json").exists():
        return None
    subprocess.run([sys.executable, str(REPO / "scripts" / "make_vision_model.py"),
                    "--tokenizer", str(TOKENIZER_DIR), "--out", str(VLM_DIR)], check=True)
    return VLM_DIR
