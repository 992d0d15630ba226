"""Which processes are alive, read from /proc (Linux): for tests about what outlives a killed process."""

from __future__ import annotations

from pathlib import Path


def _stat(pid: int) -> list[str] | None:
    """The fields of /proc/<pid>/stat after the command name (state first), or None when there is no such pid."""
    try:
        text = (Path("/proc") / str(pid) / "stat").read_text()
    except (FileNotFoundError, ProcessLookupError):
        return None
    return text.rsplit(")", 1)[1].split()  # the name, in parentheses, may hold spaces


def running(pid: int) -> bool:
    """Whether `pid` is a live process (a zombie, exited but not yet reaped by whoever adopted it, is not)."""
    fields = _stat(pid)
    return fields is not None and fields[0] != "Z"


def group_members(pgid: int) -> list[int]:
    """Every live process in process group `pgid`."""
    members = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            fields = _stat(int(entry.name))
            if fields is not None and fields[0] != "Z" and int(fields[2]) == pgid:
                members.append(int(entry.name))
    return members


def children(pid: int) -> list[int]:
    """The live children of `pid`, every thread's."""
    found = []
    for task in (Path("/proc") / str(pid) / "task").glob("*/children"):
        found += [int(p) for p in task.read_text().split()]
    return [p for p in found if running(p)]
