"""The SQLite response store: shared between connections (workers), survives reopening, bounded."""

from __future__ import annotations

import time

from gateway.responses_store import ResponseStore, open_store

CONVERSATION = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]


async def test_another_connection_sees_it_and_it_survives_reopening(tmp_path):
    path = str(tmp_path / "db" / "responses.sqlite3")
    worker_a, worker_b = ResponseStore(path), ResponseStore(path)
    await worker_a.put("resp_1", {"id": "resp_1"}, CONVERSATION)
    got = await worker_b.get("resp_1")
    assert got is not None and got.response == {"id": "resp_1"} and got.conversation == CONVERSATION
    worker_a.close()
    worker_b.close()
    restarted = ResponseStore(path)
    assert (await restarted.get("resp_1")) is not None
    assert await restarted.delete("resp_1") and not await restarted.delete("resp_1")
    assert await restarted.get("resp_1") is None


async def test_row_cap_drops_the_oldest(tmp_path):
    store = ResponseStore(str(tmp_path / "r.sqlite3"), max_rows=3)
    for i in range(5):
        await store.put(f"resp_{i}", {"i": i}, [])
    assert [await store.get(f"resp_{i}") is not None for i in range(5)] == [False, False, True, True, True]


async def test_byte_cap_keeps_the_file_bounded(tmp_path):
    path = tmp_path / "r.sqlite3"
    store = ResponseStore(str(path), max_bytes=512 * 1024)
    big = [{"role": "user", "content": "x" * 20_000}]
    for i in range(200):  # 4 MB written in all
        await store.put(f"resp_{i}", {"i": i}, big)
    assert await store.get("resp_199") is not None and await store.get("resp_0") is None
    assert path.stat().st_size < 2 * 512 * 1024


async def test_expired_rows_are_gone(tmp_path, monkeypatch):
    store = ResponseStore(str(tmp_path / "r.sqlite3"), ttl_s=60)
    await store.put("resp_old", {}, [])
    now = time.time()
    monkeypatch.setattr(time, "time", lambda: now + 61)
    assert await store.get("resp_old") is None
    await store.put("resp_new", {}, [])  # pruned on write, too
    (rows,) = store._connection().execute("SELECT COUNT(*) FROM responses").fetchone()
    assert rows == 1


def test_off_means_no_store():
    assert open_store(None) is None and open_store("off") is None and open_store("OFF") is None
