"""Which prompt blocks each engine holds, read from its KV events: the signal the router prefers endpoints by.

Each engine publishes vLLM's KV events (engine/core/kv_events.py; the same feed llm-d's precise prefix router
reads): `BlockStored` with each block's hash, its parent's hash and its tokens, `BlockRemoved`, `AllBlocksCleared`.
A `BlockIndex` keeps, per engine and model, a map from (parent, block tokens) to the block's hash, so a prompt's
leading blocks are found by walking its own token blocks from the root, with no need to recompute the engine's hash.
A chain's root is told apart by what salts it: the LoRA adapter and the extra keys on its first block (the tenant's
cache salt, an image digest), as the engine reports them.

`KvFeed` subscribes to one publisher (ZMQ SUB, topic `kv@<pod>@<model>`), first catching up through its replay
socket when it has one, and keeps one index per model. A feed that cannot connect or reads garbage only leaves its
index empty: routing falls back to load, never fails a request.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Sequence
from typing import Any

import msgpack
import zmq
import zmq.asyncio

log = logging.getLogger(__name__)

_END_SEQ = -1  # the replay socket's last frame (engine/core/kv_events.py)
_REPLAY_TIMEOUT_S = 5.0

Link = tuple[Any, tuple[int, ...]]  # (the parent's hash, or the chain's root tag; the block's tokens)


def root_tag(lora_name: str | None, extra_keys: Sequence[Any] | None) -> tuple[Any, ...]:
    """What a chain's first block is salted by: its adapter and the extra keys the engine put on it."""
    return ("root", lora_name, tuple(extra_keys or ()))


def request_root(lora_adapter: str | None, cache_salt: str | None) -> tuple[Any, ...]:
    """The root tag a request without images gets: the engine's first-block extra keys are its adapter, then the
    tenant's salt (engine/core/prefix_cache.py `_stored_event`)."""
    keys = ((lora_adapter,) if lora_adapter is not None else ()) + ((cache_salt,) if cache_salt is not None else ())
    return root_tag(lora_adapter, keys)


class BlockIndex:
    """The blocks one engine holds for one model."""

    def __init__(self) -> None:
        self.block_size = 0  # from the events; 0 until the first block is stored
        self._by_link: dict[Link, int] = {}
        self._links: dict[int, Link] = {}

    def __len__(self) -> int:
        return len(self._links)

    def apply(self, event: dict[str, Any]) -> None:
        kind = event.get("type")
        if kind == "BlockStored":
            self._stored(event)
        elif kind == "BlockRemoved":
            for block_hash in event.get("block_hashes") or ():
                link = self._links.pop(block_hash, None)
                if link is not None and self._by_link.get(link) == block_hash:
                    del self._by_link[link]
        elif kind == "AllBlocksCleared":
            self._by_link.clear()
            self._links.clear()

    def _stored(self, event: dict[str, Any]) -> None:
        hashes, tokens, size = event["block_hashes"], event["token_ids"], int(event["block_size"])
        extra = event.get("extra_keys") or [None] * len(hashes)
        self.block_size = size
        parent = event.get("parent_block_hash")
        for number, block_hash in enumerate(hashes):
            block = tuple(tokens[number * size:(number + 1) * size])
            link: Link = (parent if parent is not None else root_tag(event.get("lora_name"), extra[number]), block)
            self._by_link[link] = block_hash
            self._links[block_hash] = link
            parent = block_hash

    def leading_blocks(self, root: Any, token_ids: Sequence[int]) -> int:
        """How many of the prompt's leading full blocks this engine holds."""
        if not self.block_size:
            return 0
        held, parent = 0, root  # the root tag, then each found block's hash
        for start in range(0, len(token_ids) - self.block_size + 1, self.block_size):
            block_hash = self._by_link.get((parent, tuple(token_ids[start:start + self.block_size])))
            if block_hash is None:
                break
            held, parent = held + 1, block_hash
        return held


class KvFeed:
    """One publisher's events, applied to one `BlockIndex` per model (the topic's last part)."""

    def __init__(self, address: str, replay: str | None = None) -> None:
        self.address = address
        self.replay = replay
        self.indexes: dict[str, BlockIndex] = {}
        self.last_seq = -1
        self._replayed_through = -1  # live batches up to here came in the replay already
        self._task: asyncio.Task[None] | None = None

    def index(self, model: str) -> BlockIndex | None:
        return self.indexes.get(model)

    def apply(self, topic: bytes, seq: int, payload: bytes, replayed: bool = False) -> None:
        """One batch `[ts, [event, ...], rank]`. A live batch the replay already gave is skipped; a live sequence
        number that goes back means the publisher restarted (its engine, and its cache, are new)."""
        if replayed:
            self._replayed_through = seq
        elif seq <= self._replayed_through:
            return
        else:
            if seq <= self.last_seq:
                self.indexes.clear()
            self._replayed_through = -1
        self.last_seq = seq
        model = topic.decode(errors="replace").split("@", 2)[-1]
        index = self.indexes.setdefault(model, BlockIndex())
        _, events, *_ = msgpack.unpackb(payload, raw=False, strict_map_key=False)
        for event in events:
            index.apply(event)

    def start(self) -> None:
        if self._task is None:
            self._task = asyncio.get_running_loop().create_task(self._run())

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
            self._task = None

    async def _run(self) -> None:
        context = zmq.asyncio.Context.instance()
        sub = context.socket(zmq.SUB)
        try:
            sub.connect(self.address)
            sub.setsockopt(zmq.SUBSCRIBE, b"kv@")
            if self.replay:
                await self._catch_up(context, self.replay)
            while True:
                frames = await sub.recv_multipart()
                self._apply_frames(frames)
        finally:
            sub.close(linger=0)

    async def _catch_up(self, context: zmq.asyncio.Context, replay: str) -> None:
        """Every batch the publisher still buffers, before the live ones (which the SUB socket queues meanwhile)."""
        dealer = context.socket(zmq.DEALER)
        try:
            dealer.connect(replay)
            await dealer.send_multipart((b"", (0).to_bytes(8, "big")))
            async with asyncio.timeout(_REPLAY_TIMEOUT_S):
                while True:
                    _, *frames = await dealer.recv_multipart()
                    if len(frames) == 3 and int.from_bytes(frames[1], "big", signed=True) == _END_SEQ:
                        return
                    self._apply_frames(frames, replayed=True)
        except TimeoutError:
            log.warning("no KV event replay from %s; following the live events only", replay)
        finally:
            dealer.close(linger=0)

    def _apply_frames(self, frames: list[bytes], replayed: bool = False) -> None:
        if len(frames) != 3:
            return
        topic, seq, payload = frames
        try:
            self.apply(topic, int.from_bytes(seq, "big", signed=True), payload, replayed)
        except Exception:  # a malformed batch must not stop the feed
            log.warning("ignoring a malformed KV event batch from %s", self.address, exc_info=True)
