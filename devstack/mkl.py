"""Opt-in: force MKL's Intel code paths on AMD CPUs (docs/cpu-decode.md, "What mattered", 1).

The torch wheel's MKL picks a slow small-M sgemm path on AMD; an LD_PRELOAD of a one-line library
that answers "this is an Intel CPU" selects the fast kernels. Measured here: decode step B=1 56 -> 40 ms,
B=8 81 -> 65 ms, B=16 unchanged, prefill ~10 % slower; engine c8 82 -> 95 tok/s. It is undocumented
and process-wide, so it stays off unless SIE_MKL_INTEL_KERNELS=1.
"""

from __future__ import annotations

import subprocess
from pathlib import Path

SOURCE = "int mkl_serv_intel_cpu_true(void) { return 1; }\n"


def preload_library(build_dir: Path) -> Path:
    """Build (once) and return the shared library to put on LD_PRELOAD."""
    build_dir.mkdir(parents=True, exist_ok=True)
    library = build_dir / "libmkl_intel_cpu.so"
    if not library.exists():
        source = build_dir / "mkl_intel_cpu.c"
        source.write_text(SOURCE)
        subprocess.run(["cc", "-shared", "-fPIC", "-O2", "-o", str(library), str(source)], check=True)
    return library


if __name__ == "__main__":
    print(preload_library(Path(__file__).resolve().parents[1] / "build"))
