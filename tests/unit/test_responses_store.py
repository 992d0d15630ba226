"""The SQLite response store: shared between connections (workers), survives reopening, bounded, and scoped to the
owner of each row."""

from __future__ import annotations

import sqlite3
import time

from gateway.responses_store import ResponseStore, open_store

OWNER = "key:0123"
CONVERSATION = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]


async def test_another_connection_sees_it_and_it_survives_reopening(tmp_path):
    path = str(tmp_path / "db" / "responses.sqlite3")
    worker_a, worker_b = ResponseStore(path), ResponseStore(path)
    await worker_a.put("resp_1", {"id": "resp_1"}, CONVERSATION, owner=OWNER)
    got = await worker_b.get("resp_1", owner=OWNER)
    assert got is not None and got.response == {"id": "resp_1"} and got.conversation == CONVERSATION
    worker_a.close()
    worker_b.close()
    restarted = ResponseStore(path)
    assert (await restarted.get("resp_1", owner=OWNER)) is not None
    assert await restarted.delete("resp_1", owner=OWNER) and not await restarted.delete("resp_1", owner=OWNER)
    assert await restarted.get("resp_1", owner=OWNER) is None


async def test_row_cap_drops_the_oldest(tmp_path):
    store = ResponseStore(str(tmp_path / "r.sqlite3"), max_rows=3)
    for i in range(5):
        await store.put(f"resp_{i}", {"i": i}, [], owner=OWNER)
    assert [await store.get(f"resp_{i}", owner=OWNER) is not None for i in range(5)] == [False, False, True, True, True]


async def test_byte_cap_keeps_the_file_bounded(tmp_path):
    path = tmp_path / "r.sqlite3"
    store = ResponseStore(str(path), max_bytes=512 * 1024)
    big = [{"role": "user", "content": "x" * 20_000}]
    for i in range(200):  # 4 MB written in all
        await store.put(f"resp_{i}", {"i": i}, big, owner=OWNER)
    assert await store.get("resp_199", owner=OWNER) is not None and await store.get("resp_0", owner=OWNER) is None
    assert path.stat().st_size < 2 * 512 * 1024


async def test_expired_rows_are_gone(tmp_path, monkeypatch):
    store = ResponseStore(str(tmp_path / "r.sqlite3"), ttl_s=60)
    await store.put("resp_old", {}, [], owner=OWNER)
    now = time.time()
    monkeypatch.setattr(time, "time", lambda: now + 61)
    assert await store.get("resp_old", owner=OWNER) is None
    await store.put("resp_new", {}, [], owner=OWNER)  # pruned on write, too
    (rows,) = store._connection().execute("SELECT COUNT(*) FROM responses").fetchone()
    assert rows == 1


def test_off_means_no_store():
    assert open_store(None) is None and open_store("off") is None and open_store("OFF") is None


async def test_another_owner_finds_nothing_and_deletes_nothing(tmp_path):
    store = ResponseStore(str(tmp_path / "r.sqlite3"))
    await store.put("resp_1", {"id": "resp_1"}, CONVERSATION, owner=OWNER)
    assert await store.get("resp_1", owner="key:other") is None
    assert not await store.delete("resp_1", owner="key:other")
    assert (await store.get("resp_1", owner=OWNER)) is not None  # the failed delete left it alone
    assert await store.delete("resp_1", owner=OWNER)


async def test_a_store_file_from_before_owners_opens_and_its_rows_are_nobodys(tmp_path):
    path = tmp_path / "old.sqlite3"
    old = sqlite3.connect(path)
    old.executescript("""
        CREATE TABLE responses (id TEXT PRIMARY KEY, created_at REAL NOT NULL, response BLOB NOT NULL,
                                conversation BLOB NOT NULL);
        CREATE INDEX responses_created_at ON responses (created_at);
    """)
    old.execute("INSERT INTO responses VALUES ('resp_old', ?, '{}', '[]')", (time.time(),))
    old.commit()
    old.close()
    first, second = ResponseStore(str(path)), ResponseStore(str(path))  # two workers open it: one migration
    assert await first.get("resp_old", owner=OWNER) is None
    assert await second.get("resp_old", owner="anonymous") is None
    assert not await second.delete("resp_old", owner=OWNER)
    await first.put("resp_new", {"id": "resp_new"}, [], owner=OWNER)
    assert (await second.get("resp_new", owner=OWNER)) is not None
    (rows,) = first._connection().execute("SELECT COUNT(*) FROM responses").fetchone()
    assert rows == 2  # the old row is still there, for the TTL and the bounds to take
