"""vLLM's KV event structs, copied from vllm 0.32.0's `vllm/distributed/kv_events.py` (Apache-2.0, the vLLM
authors), fields, order, defaults and msgspec options unchanged, less the methods: the decoder that vLLM's own
subscribers and llm-d's vLLM adapter mirror. tests/unit/test_kv_events.py decodes our events with them; where
the peer bench's vLLM venv is installed (bench/install_vllm_peer.sh), the same bytes decode with the installed
module too (the test says so in its output).
"""

from __future__ import annotations

from typing import Any

import msgspec

ExternalBlockHash = bytes | int


class EventBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):  # type: ignore[call-arg]
    ts: float
    events: list[Any]
    data_parallel_rank: int | None = None


class KVCacheEvent(msgspec.Struct, omit_defaults=True, gc=False, tag=True):  # type: ignore[call-arg]
    """Base class for all KV cache-related events."""


class BlockStored(KVCacheEvent):
    block_hashes: list[ExternalBlockHash]
    parent_block_hash: ExternalBlockHash | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None
    lora_name: str | None
    extra_keys: list[tuple[Any, ...] | None] | None = None
    group_idx: int | None = None
    kv_cache_spec_kind: str | None = None
    kv_cache_spec_sliding_window: int | None = None
    locality: str | None = None
    ownership: str | None = None
    session_id: str | None = None


class BlockRemoved(KVCacheEvent):
    block_hashes: list[ExternalBlockHash]
    medium: str | None
    group_idx: int | None = None
    locality: str | None = None
    ownership: str | None = None


class AllBlocksCleared(KVCacheEvent):
    pass


class KVEventBatch(EventBatch):
    events: list[BlockStored | BlockRemoved | AllBlocksCleared]


DECODER = msgspec.msgpack.Decoder(type=KVEventBatch)
ENCODER = msgspec.msgpack.Encoder()
