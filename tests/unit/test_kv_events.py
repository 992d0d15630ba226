"""KV events: the prefix cache's stored and evicted blocks, in vLLM's wire format, over ZMQ with replay."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import zmq

from engine.core import kv_events
from engine.core.kv_events import ZmqPublisher, encode_batch
from engine.sampling_params import SamplingParams
from tests import vllm_kv_events as vllm

from .engine_run import Run

REPO = Path(__file__).resolve().parents[2]
VLLM_PYTHON = Path(os.environ.get("VLLM_PEER_VENV", REPO / ".cache" / "vllm-peer" / "venv")) / "bin" / "python"


def events_core(make_scheduler, real_engine, prefix_tokens: int):
    from engine.core.engine_core import EngineCore

    base = make_scheduler()
    batches: list[list[dict]] = []
    core = EngineCore(base.runner, real_engine.sampler, real_engine.tokenizer, prefix_cache_tokens=prefix_tokens,
                      publish_kv_events=lambda events: batches.append(list(events)))
    return core, batches


def decoded(batches: list[list[dict]]) -> list:
    """Every event, through vLLM's own decoder."""
    return [e for events in batches for e in vllm.DECODER.decode(encode_batch(events, 1.0)).events]


def test_stored_blocks_carry_their_tokens_and_chain(make_scheduler, real_engine):
    core, batches = events_core(make_scheduler, real_engine, prefix_tokens=1024)
    prompt = real_engine.encode_prompt("Tell me about the history of the printing press in Europe, from the first "
                                       "movable type to the newspapers of the eighteenth century, in a few lines.")
    assert len(prompt) > 16
    run = Run(core)
    run.add("a", prompt, SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))
    run.until_done()
    events = decoded(batches)
    assert isinstance(events[0], vllm.AllBlocksCleared)  # a new process holds no block yet
    stored = [e for e in events if isinstance(e, vllm.BlockStored)]
    assert stored and all(e.block_size == 16 and e.medium == "GPU" and e.lora_name is None for e in stored)
    # the prompt's full blocks, then (when it finished) the rest of prompt + output; the hashes chain
    first = stored[0]
    assert first.parent_block_hash is None
    assert first.token_ids == prompt[: 16 * len(first.block_hashes)]
    chain = [h for e in stored for h in e.block_hashes]
    assert len(set(chain)) == len(chain)
    for before, after in zip(stored, stored[1:], strict=False):
        assert after.parent_block_hash == before.block_hashes[-1]
    # the same prompt again is a hit: nothing new is stored
    batches.clear()
    run.add("b", prompt, SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))
    run.until_done()
    assert not [e for e in decoded(batches) if isinstance(e, vllm.BlockStored)]


def test_evicted_blocks_are_removed_by_the_hashes_they_were_stored_under(make_scheduler, real_engine):
    core, batches = events_core(make_scheduler, real_engine, prefix_tokens=64)  # four blocks
    run = Run(core)
    for i, topic in enumerate(["rivers and the sea", "mountains and their weather"]):
        prompt = real_engine.encode_prompt(f"Prompt {i} is about {topic}. " * 8)  # three blocks or more each
        assert len(prompt) >= 48
        run.add(f"r{i}", prompt, SamplingParams(temperature=0, max_tokens=2))
        run.until_done()
    events = decoded(batches)
    stored = {h for e in events if isinstance(e, vllm.BlockStored) for h in e.block_hashes}
    removed = [h for e in events if isinstance(e, vllm.BlockRemoved) for h in e.block_hashes]
    assert removed and set(removed) <= stored
    held = stored - set(removed)
    assert len(held) <= 4 and held == set(core.scheduler.prefix_cache.entries)


def test_keys_and_salt_are_stable_across_processes_and_named_in_extra_keys(make_scheduler, real_engine):
    """A router that restarts, or another replica, must read the same key for the same block and salt."""
    from engine.core.block_pool import BlockPool
    from engine.core.prefix_cache import PrefixCache

    cache = PrefixCache(BlockPool(16), 256)
    tokens = list(range(100, 140))
    here = [key for key, _, _ in cache._chain(tokens, ("pirate", None, "tenant-a"), len(tokens))]
    script = ("import sys; from engine.core.prefix_cache import PrefixCache\n"
              "cache = PrefixCache.__new__(PrefixCache); cache.block_tokens = 16\n"
              f"print([key for key, _, _ in cache._chain({tokens}, ('pirate', None, 'tenant-a'), {len(tokens)})])")
    other = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, cwd=REPO, check=True,
                           env={**os.environ, "PYTHONHASHSEED": "7"})  # another process, another str hash seed
    assert other.stdout.strip() == str(here)
    assert here != [key for key, _, _ in cache._chain(tokens, ("pirate", None, "tenant-b"), len(tokens))]
    event = kv_events.block_stored(here[:1], None, tokens[:16], 16, "pirate", [("pirate", "tenant-a")])
    (decoded_event,) = vllm.DECODER.decode(encode_batch([event], 2.0)).events
    assert decoded_event.lora_name == "pirate" and decoded_event.extra_keys == [("pirate", "tenant-a")]


def test_bytes_equal_what_vllms_own_encoder_writes():
    """Same fields, order and omitted defaults: re-encoding with vLLM's structs gives our bytes back."""
    events = [kv_events.all_blocks_cleared(),
              kv_events.block_stored([11, 12], 10, list(range(32)), 16, None, None),
              kv_events.block_removed([11])]
    ours = encode_batch(events, 3.5)
    assert vllm.ENCODER.encode(vllm.DECODER.decode(ours)) == ours
    if VLLM_PYTHON.exists():  # the peer bench's venv: decode with the installed vLLM module itself
        check = ("import sys; from vllm.distributed.kv_events import KVEventBatch; import msgspec;"
                 "b = msgspec.msgpack.Decoder(KVEventBatch).decode(sys.stdin.buffer.read());"
                 "print([type(e).__name__ for e in b.events], b.events[1].block_hashes, b.events[1].token_ids[:3])")
        out = subprocess.run([str(VLLM_PYTHON), "-c", check], input=ours, capture_output=True, check=True)
        assert out.stdout.decode().strip() == "['AllBlocksCleared', 'BlockStored', 'BlockRemoved'] [11, 12] [0, 1, 2]"
        print("decoded with the installed vllm module too")


def test_published_batches_arrive_in_order_and_replay_from_a_sequence_number():
    publisher = ZmqPublisher("tcp://127.0.0.1:*", "kv@pod-0@smollm2", replay_endpoint="tcp://127.0.0.1:*")
    ctx = zmq.Context.instance()
    sub = ctx.socket(zmq.SUB)
    sub.setsockopt(zmq.SUBSCRIBE, b"kv@")
    sub.connect(publisher.endpoint)
    try:
        # a PUB drops what it sends before a subscriber has joined: publish until the first one arrives
        while not sub.poll(100):
            publisher.publish([kv_events.all_blocks_cleared()])
        while sub.poll(200):
            sub.recv_multipart()
        publisher.publish([kv_events.block_removed([1])])
        publisher.publish([kv_events.block_removed([2])])
        frames = [sub.recv_multipart() for _ in range(2)]
        assert [f[0] for f in frames] == [b"kv@pod-0@smollm2"] * 2
        seqs = [int.from_bytes(f[1], "big") for f in frames]
        assert seqs[1] == seqs[0] + 1
        assert [vllm.DECODER.decode(f[2]).events[0].block_hashes for f in frames] == [[1], [2]]
        replay = ctx.socket(zmq.DEALER)  # one request, many replies (vLLM's subscribers do the same)
        replay.connect(publisher.replay_endpoint)
        replay.send_multipart((b"", seqs[0].to_bytes(8, "big")))
        replayed = []
        while True:
            _, topic, seq, payload = replay.recv_multipart()
            if seq == kv_events.END_SEQ:
                break
            assert topic == b"kv@pod-0@smollm2"
            replayed.append(int.from_bytes(seq, "big"))
        replay.close(linger=0)
        assert replayed == seqs
    finally:
        sub.close(linger=0)
        publisher.close()
