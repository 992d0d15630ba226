"""The engine's pins as Python 3.10 resolves them (the NGC Triton image's interpreter), read from pyproject.toml.

    python .ci/py310_pins.py check       every engine pin has a wheel for CPython 3.10 on manylinux x86_64
    python .ci/py310_pins.py torch-free  the pins a torch-free 3.10 test venv installs (engine + pytest)

Runs on the project's 3.11 interpreter (tomllib, packaging); asks the package index with pip's own client.
"""

from __future__ import annotations

import re
import subprocess
import sys
import tomllib
from pathlib import Path

from packaging.requirements import Requirement

REPO = Path(__file__).resolve().parents[1]
ENV = {"python_version": "3.10", "python_full_version": "3.10.13", "sys_platform": "linux",
       "platform_system": "Linux", "platform_machine": "x86_64", "implementation_name": "cpython",
       "platform_python_implementation": "CPython", "os_name": "posix", "extra": ""}
NEEDS_TORCH = {"torch", "accelerate", "peft", "xgrammar"}  # torch (a CUDA build of GBs for cp310) or its dependents
TEST_PINS = {"pytest", "pytest-asyncio", "pytest-timeout"}  # what pyproject's pytest options name
# The NGC tritonserver 24.10 image is Ubuntu 22.04 (glibc 2.35): every manylinux tag up to 2_35 installs there.
PLATFORMS = ["manylinux2014_x86_64"] + [f"manylinux_2_{v}_x86_64" for v in (17, 24, 27, 28, 31, 34, 35)]


def pins(extra: str) -> list[Requirement]:
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    reqs = [Requirement(r) for r in project["optional-dependencies"][extra]]
    return [r for r in reqs if r.marker is None or r.marker.evaluate(ENV)]


def has_cp310_wheel(req: Requirement) -> bool:
    version = next(iter(req.specifier)).version
    out = subprocess.run(
        [sys.executable, "-m", "pip", "index", "versions", req.name, "--python-version", "3.10",
         *(arg for tag in PLATFORMS for arg in ("--platform", tag)), "--only-binary=:all:",
         "--disable-pip-version-check"],
        capture_output=True, text=True,
    ).stdout
    found = re.search(r"Available versions: (.*)", out)
    return found is not None and version in [v.strip() for v in found.group(1).split(",")]


def main(command: str) -> int:
    if command == "check":
        missing = []
        for req in pins("engine"):
            ok = has_cp310_wheel(req)
            print(f"  cp310 wheel {'ok     ' if ok else 'MISSING'} {req}")
            if not ok:
                missing.append(str(req))
        if missing:
            print(f"py310: no CPython 3.10 wheel for {', '.join(missing)} (the NGC image cannot install them)")
            return 1
        return 0
    if command == "torch-free":
        chosen = [r for r in pins("engine") if r.name not in NEEDS_TORCH]
        chosen += [r for r in pins("test") if r.name in TEST_PINS]
        print(" ".join(str(r).split(";")[0] for r in chosen))
        return 0
    print(__doc__)
    return 2


if __name__ == "__main__":
    sys.exit(main(sys.argv[1] if len(sys.argv) > 1 else ""))
