"""KV cache events in vLLM's wire format, for KV-aware routers (llm-d's precise prefix routing, the Gateway API
Inference Extension's endpoint picker): which prompt blocks this engine holds, as they are stored and evicted.

The events are vLLM's (`vllm/distributed/kv_events.py`): a batch `[ts, [event, ...], data_parallel_rank]`, each
event a msgpack map tagged by `type` - `BlockStored` (block hashes, the parent's hash, the blocks' token ids, the
block size, the LoRA name, the medium, the extra keys that salt each block), `BlockRemoved` (hashes) or
`AllBlocksCleared` - with the same field order and the same omitted defaults as vLLM's msgspec structs, so vLLM's own
decoder and llm-d's vLLM adapter read them. A block's hash is the 64-bit chain key of engine.core.prefix_cache, so a
consumer that indexes by the hashes in `BlockStored` finds the same keys in `BlockRemoved`.

`ZmqPublisher` sends each batch on a PUB socket as `(topic, sequence number as 8 big-endian bytes, payload)`, keeps
the last `buffer_batches` for replay, and answers a ROUTER request carrying a start sequence number with every
buffered batch from there, then an end marker (sequence -1): a router that restarts catches up. The engine thread
only appends to a list; encoding and sending happen on the publisher's thread.
"""

from __future__ import annotations

import collections
import logging
import queue
import threading
import time
from typing import Any

import msgpack
import zmq

log = logging.getLogger(__name__)

MEDIUM = "GPU"  # the engine's own KV tier, as vLLM names it on any device (its CPU build included)
END_SEQ = (-1).to_bytes(8, "big", signed=True)


def block_stored(hashes: list[int], parent: int | None, token_ids: list[int], block_size: int,
                 lora_name: str | None, extra_keys: list[tuple[Any, ...] | None] | None) -> dict[str, Any]:
    event: dict[str, Any] = {"type": "BlockStored", "block_hashes": hashes, "parent_block_hash": parent,
                             "token_ids": token_ids, "block_size": block_size, "lora_id": None, "medium": MEDIUM,
                             "lora_name": lora_name}
    if extra_keys is not None:  # vLLM's omit_defaults: a field at its default is left out
        event["extra_keys"] = [list(k) if k is not None else None for k in extra_keys]
    event["group_idx"] = 0
    return event


def block_removed(hashes: list[int]) -> dict[str, Any]:
    return {"type": "BlockRemoved", "block_hashes": hashes, "medium": MEDIUM, "group_idx": 0}


def all_blocks_cleared() -> dict[str, Any]:
    return {"type": "AllBlocksCleared"}


def encode_batch(events: list[dict[str, Any]], ts: float, rank: int = 0) -> bytes:
    return msgpack.packb([ts, events, rank], use_bin_type=True)


class ZmqPublisher:
    def __init__(self, endpoint: str, topic: str, replay_endpoint: str | None = None, buffer_batches: int = 10_000,
                 max_queue: int = 100_000) -> None:
        self.topic = topic.encode()
        self._queue: queue.Queue[list[dict[str, Any]] | None] = queue.Queue(maxsize=max_queue)
        self._buffer: collections.deque[tuple[int, bytes]] = collections.deque(maxlen=buffer_batches)
        self._ctx: zmq.Context = zmq.Context.instance()
        self._pub = self._ctx.socket(zmq.PUB)
        self._pub.bind(endpoint)
        self.endpoint = self._pub.getsockopt_string(zmq.LAST_ENDPOINT)
        self._replay = None
        self.replay_endpoint = None
        if replay_endpoint:
            self._replay = self._ctx.socket(zmq.ROUTER)
            self._replay.bind(replay_endpoint)
            self.replay_endpoint = self._replay.getsockopt_string(zmq.LAST_ENDPOINT)
        self._seq = 0
        self.dropped = 0  # batches lost to a full queue (the engine never blocks on the router)
        self._thread = threading.Thread(target=self._run, name="kv-events", daemon=True)
        self._thread.start()

    def publish(self, events: list[dict[str, Any]]) -> None:
        try:
            self._queue.put_nowait(events)
        except queue.Full:
            self.dropped += 1

    def close(self) -> None:
        self._queue.put(None)
        self._thread.join(timeout=2)
        self._pub.close(linger=0)
        if self._replay is not None:
            self._replay.close(linger=0)

    def _run(self) -> None:
        while True:
            if self._replay is not None and self._replay.poll(0):
                try:
                    self._serve_replay()
                except Exception:  # a malformed request must not stop the events
                    log.exception("KV event replay failed")
            try:
                events = self._queue.get(timeout=0.05)
            except queue.Empty:
                continue
            if events is None:
                return
            payload = encode_batch(events, time.time())
            seq = self._seq.to_bytes(8, "big")
            self._pub.send_multipart((self.topic, seq, payload))
            self._buffer.append((self._seq, payload))
            self._seq += 1

    def _serve_replay(self) -> None:
        assert self._replay is not None
        frame = self._replay.recv_multipart()
        if len(frame) != 3:
            log.warning("ignoring a KV event replay request of %d frames", len(frame))
            return
        client, _, start = frame
        first = int.from_bytes(start, "big")
        for seq, payload in list(self._buffer):
            if seq >= first:
                self._replay.send_multipart((client, b"", self.topic, seq.to_bytes(8, "big"), payload))
        self._replay.send_multipart((client, b"", b"", END_SEQ, b""))
