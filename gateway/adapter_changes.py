"""Run-time LoRA changes seen by every gunicorn worker of one gateway at once (docs/lora.md).

A load or unload reaches one worker; it alone learns the new adapter list from the engines' answers. Its siblings
would learn it at their next background refresh (`SIE_GATEWAY_MODEL_REFRESH_S`), so a client that loads an adapter
and then lists or uses it could meet a sibling that has not heard yet. The worker that made the change therefore
replaces a small file in the folder all workers share (`SIE_GATEWAY_STATE_DIR`, made by docker/gunicorn.conf.py);
every worker looks at that file's identity (a `stat`, no read) before it resolves a model id, and refreshes first
when it changed. A gateway with no shared folder (one process, or the tests' in-process app) has nothing to tell.
"""

from __future__ import annotations

import os
import uuid
from pathlib import Path

MARKER = "lora-adapters.changed"


class AdapterChanges:
    def __init__(self, state_dir: str | None) -> None:
        self.path = Path(state_dir) / MARKER if state_dir else None
        self.seen = self.stamp()

    def stamp(self) -> tuple[int, int] | None:
        """The marker's identity now: every replace makes a new inode (and a new mtime), None before the first."""
        if self.path is None:
            return None
        try:
            status = self.path.stat()
        except FileNotFoundError:
            return None
        return status.st_ino, status.st_mtime_ns

    def pending(self) -> tuple[int, int] | None:
        """The stamp to record once this worker has refreshed, or None when it is up to date."""
        now = self.stamp()
        return now if now != self.seen else None

    def announce(self) -> None:
        """Tell the sibling workers that the adapter list changed (written beside, then renamed: never half seen)."""
        if self.path is None:
            return
        part = self.path.with_name(f".{MARKER}.{uuid.uuid4().hex}")
        part.write_text(uuid.uuid4().hex)
        os.replace(part, self.path)
