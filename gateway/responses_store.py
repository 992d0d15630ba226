"""Stored Responses (`store: true`, `previous_response_id`, `GET /v1/responses/{id}`) on SQLite.

One database file, opened by every gunicorn worker (WAL mode: readers never block the writer), so a
response stored by one worker is found by the next request on any other, and after a restart. Bounded:
rows older than the TTL are dropped, and past the row cap or the byte cap the oldest go first (freed pages
are reused, so the file stays near the cap). Replicas share it by pointing `SIE_RESPONSES_STORE` at one
file on a volume they all mount with working POSIX locks (docs/routes.md, "What is stored").

A row is the finished Response object and the conversation that produced it (input items as wire
messages, then the answer), which is what `previous_response_id` replays, and its owner: the tenant of the key that
made it (gateway/auth_tokens.py), never the key. Every read and delete names the owner, so a row of another
tenant is exactly as absent as one never stored. Rows from a store file older than owners have none (NULL): they
match no owner, so nobody reads, continues or deletes them, and they leave with the TTL and the bounds.
sqlite3 blocks, so every call runs in a thread, never on the event loop.
"""

from __future__ import annotations

import asyncio
import sqlite3
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import orjson

_SCHEMA = """
CREATE TABLE IF NOT EXISTS responses (
    id TEXT PRIMARY KEY,
    created_at REAL NOT NULL,
    response BLOB NOT NULL,
    conversation BLOB NOT NULL,
    owner TEXT
);
CREATE INDEX IF NOT EXISTS responses_created_at ON responses (created_at);
"""


@dataclass(frozen=True)
class StoredResponse:
    response: dict[str, Any]
    conversation: list[dict[str, Any]]  # wire messages: the replayed history, this input, the answer


class ResponseStore:
    def __init__(self, path: str, *, max_rows: int = 10_000, max_bytes: int = 256 * 1024 * 1024,
                 ttl_s: float = 7 * 24 * 3600.0) -> None:
        self.path = path
        self.max_rows = max_rows
        self.max_bytes = max_bytes
        self.ttl_s = ttl_s
        self._conn: sqlite3.Connection | None = None
        self._lock = threading.Lock()  # one connection per process, used from worker threads

    def _connection(self) -> sqlite3.Connection:
        # opened on first use: after gunicorn forks, each worker gets its own connection
        if self._conn is None:
            Path(self.path).parent.mkdir(parents=True, exist_ok=True)
            conn = sqlite3.connect(self.path, timeout=10, check_same_thread=False, isolation_level=None)
            conn.execute("PRAGMA journal_mode=WAL")
            conn.execute("PRAGMA synchronous=NORMAL")
            conn.executescript(_SCHEMA)
            _add_owner_column(conn)
            self._conn = conn
        return self._conn

    async def put(self, response_id: str, response: dict[str, Any], conversation: list[dict[str, Any]], *,
                  owner: str) -> None:
        await asyncio.to_thread(self._put, response_id, response, conversation, owner)

    async def get(self, response_id: str, *, owner: str) -> StoredResponse | None:
        """The row, if `owner` owns it; another owner's row is None, as a missing one."""
        return await asyncio.to_thread(self._get, response_id, owner)

    async def delete(self, response_id: str, *, owner: str) -> bool:
        return await asyncio.to_thread(self._delete, response_id, owner)

    def close(self) -> None:
        with self._lock:
            if self._conn is not None:
                self._conn.close()
                self._conn = None

    def _put(self, response_id: str, response: dict[str, Any], conversation: list[dict[str, Any]],
             owner: str) -> None:
        now = time.time()
        with self._lock:
            conn = self._connection()
            conn.execute("BEGIN IMMEDIATE")
            try:
                conn.execute("INSERT OR REPLACE INTO responses (id, created_at, response, conversation, owner) "
                             "VALUES (?, ?, ?, ?, ?)",
                             (response_id, now, orjson.dumps(response), orjson.dumps(conversation), owner))
                self._prune(conn, now)
                conn.execute("COMMIT")
            except BaseException:
                conn.execute("ROLLBACK")
                raise

    def _prune(self, conn: sqlite3.Connection, now: float) -> None:
        conn.execute("DELETE FROM responses WHERE created_at < ?", (now - self.ttl_s,))
        conn.execute("DELETE FROM responses WHERE id IN "
                     "(SELECT id FROM responses ORDER BY created_at DESC LIMIT -1 OFFSET ?)", (self.max_rows,))
        while self._used_bytes(conn) > self.max_bytes:
            (rows,) = conn.execute("SELECT COUNT(*) FROM responses").fetchone()
            if rows <= 1:
                return
            conn.execute("DELETE FROM responses WHERE id IN "
                         "(SELECT id FROM responses ORDER BY created_at LIMIT ?)", (max(rows // 10, 1),))

    @staticmethod
    def _used_bytes(conn: sqlite3.Connection) -> int:
        (pages,) = conn.execute("PRAGMA page_count").fetchone()
        (free,) = conn.execute("PRAGMA freelist_count").fetchone()
        (size,) = conn.execute("PRAGMA page_size").fetchone()
        return int((pages - free) * size)

    def _get(self, response_id: str, owner: str) -> StoredResponse | None:
        with self._lock:
            row = self._connection().execute(
                "SELECT response, conversation FROM responses WHERE id = ? AND owner = ? AND created_at >= ?",
                (response_id, owner, time.time() - self.ttl_s)).fetchone()
        if row is None:
            return None
        return StoredResponse(orjson.loads(row[0]), orjson.loads(row[1]))

    def _delete(self, response_id: str, owner: str) -> bool:
        with self._lock:
            cursor = self._connection().execute("DELETE FROM responses WHERE id = ? AND owner = ?",
                                                (response_id, owner))
        return cursor.rowcount > 0


def _add_owner_column(conn: sqlite3.Connection) -> None:
    """A store file from before owners: add the column (its rows keep NULL, nobody's). In one write transaction,
    so two workers opening the same old file do not both add it."""
    conn.execute("BEGIN IMMEDIATE")
    try:
        columns = {row[1] for row in conn.execute("PRAGMA table_info(responses)")}
        if "owner" not in columns:
            conn.execute("ALTER TABLE responses ADD COLUMN owner TEXT")
        conn.execute("COMMIT")
    except BaseException:
        conn.execute("ROLLBACK")
        raise


def open_store(path: str | None, **bounds: Any) -> ResponseStore | None:
    """The configured store, or None when storing is off (`SIE_RESPONSES_STORE=off`)."""
    if not path or path.lower() == "off":
        return None
    return ResponseStore(path, **bounds)
