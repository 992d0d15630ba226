"""Routing by the engines' KV events: the gateway's block index reads what the engine publishes, and the router
puts first the endpoint that holds a prompt's leading blocks, unless loads are out of balance."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from typing import Any

import pytest

from engine.core import kv_events
from engine.core.kv_events import ZmqPublisher, encode_batch
from engine.request import EngineRequest
from engine.sampling_params import SamplingParams
from gateway.domain import GenerationRequest, TokenizerResult
from gateway.kv_blocks import KvFeed, request_root
from gateway.prefix_routing import BALANCE_ABS, PrefixRouting

from .engine_run import Run

TOPIC = b"kv@pod-a@m"
UNSALTED = request_root(None, None)


def _engine_feed(make_scheduler, real_engine, salts_and_prompts: list[tuple[str | None, list[int]]]) -> KvFeed:
    """A feed that read, through msgpack as on the wire, what a real engine core published while serving these."""
    from engine.core.engine_core import EngineCore

    base = make_scheduler()
    feed = KvFeed("tcp://unused")
    seq = iter(range(1_000_000))
    core = EngineCore(base.runner, real_engine.sampler, real_engine.tokenizer, prefix_cache_tokens=1024,
                      publish_kv_events=lambda events: feed.apply(TOPIC, next(seq), encode_batch(events, 1.0)))
    run = Run(core)
    for number, (salt, prompt) in enumerate(salts_and_prompts):
        run.outputs[str(number)] = []
        core.scheduler.add(EngineRequest(str(number), prompt, SamplingParams(temperature=0, max_tokens=2),
                                         run.outputs[str(number)].append, True, cache_salt=salt))
        run.until_done()
    return feed


def test_the_index_finds_the_leading_blocks_an_engine_published(make_scheduler, real_engine):
    prompt = list(range(1000, 1000 + 16 * 5 + 3))  # five full blocks, and a tail
    feed = _engine_feed(make_scheduler, real_engine, [(None, prompt)])
    index = feed.index("m")
    assert index is not None and index.block_size == 16
    assert index.leading_blocks(UNSALTED, prompt) == 5
    assert index.leading_blocks(UNSALTED, prompt[:40]) == 2  # a prompt that shares two blocks
    assert index.leading_blocks(UNSALTED, prompt[:16] + [7] * 64) == 1  # diverges in its second block
    assert index.leading_blocks(UNSALTED, [7] * 80) == 0
    assert index.leading_blocks(request_root(None, "tenant-b"), prompt) == 0  # another tenant's root
    assert index.leading_blocks(request_root("pirate", None), prompt) == 0  # another adapter's


def test_a_tenants_blocks_are_found_under_that_tenant_alone(make_scheduler, real_engine):
    prompt = list(range(2000, 2000 + 16 * 3))
    index = _engine_feed(make_scheduler, real_engine, [("tenant-a", prompt)]).index("m")
    assert index is not None
    assert index.leading_blocks(request_root(None, "tenant-a"), prompt) >= 2
    assert index.leading_blocks(request_root(None, "tenant-b"), prompt) == 0
    assert index.leading_blocks(UNSALTED, prompt) == 0


def test_removed_and_cleared_blocks_are_forgotten():
    feed = KvFeed("tcp://unused")
    tokens = list(range(48))
    feed.apply(TOPIC, 0, encode_batch([kv_events.block_stored([11, 12, 13], None, tokens, 16, None, None)], 1.0))
    index = feed.index("m")
    assert index is not None and index.leading_blocks(UNSALTED, tokens) == 3
    feed.apply(TOPIC, 1, encode_batch([kv_events.block_removed([12])], 1.0))
    assert index.leading_blocks(UNSALTED, tokens) == 1  # the chain breaks where a block went
    feed.apply(TOPIC, 2, encode_batch([kv_events.all_blocks_cleared()], 1.0))
    assert index.leading_blocks(UNSALTED, tokens) == 0 and len(index) == 0


def test_replayed_batches_count_once_and_a_restarted_publisher_starts_afresh():
    feed = KvFeed("tcp://unused")
    tokens = list(range(32))
    stored = encode_batch([kv_events.block_stored([21, 22], None, tokens, 16, None, None)], 1.0)
    removed = encode_batch([kv_events.block_removed([22])], 1.0)
    feed.apply(TOPIC, 0, stored, replayed=True)
    feed.apply(TOPIC, 1, removed, replayed=True)
    feed.apply(TOPIC, 0, stored)  # the same batches again, live: queued while the replay ran
    feed.apply(TOPIC, 1, removed)
    index = feed.index("m")
    assert index is not None and index.leading_blocks(UNSALTED, tokens) == 1
    feed.apply(TOPIC, 2, encode_batch([kv_events.block_stored([23], 21, tokens[16:], 16, None, None)], 1.0))
    assert index.leading_blocks(UNSALTED, tokens) == 2
    feed.apply(TOPIC, 0, encode_batch([kv_events.block_stored([31], None, tokens[:16], 16, None, None)], 1.0))
    fresh = feed.index("m")  # seq 0 again, live: a new engine, whose cache holds only what it says now
    assert fresh is not index and fresh is not None and fresh.leading_blocks(UNSALTED, tokens) == 1


async def test_a_feed_catches_up_through_the_replay_socket_then_follows_live_events():
    publisher = ZmqPublisher("tcp://127.0.0.1:*", TOPIC.decode(), "tcp://127.0.0.1:*")
    tokens = list(range(64))
    feed = KvFeed(publisher.endpoint, publisher.replay_endpoint)
    try:
        publisher.publish([kv_events.block_stored([1, 2], None, tokens[:32], 16, None, None)])  # before the feed
        await asyncio.sleep(0.2)
        feed.start()
        await _until(lambda: feed.index("m") is not None and feed.index("m").leading_blocks(UNSALTED, tokens) == 2)
        publisher.publish([kv_events.block_stored([3, 4], 2, tokens[32:], 16, None, None)])
        await _until(lambda: feed.index("m").leading_blocks(UNSALTED, tokens) == 4)
    finally:
        await feed.stop()
        publisher.close()


async def _until(condition, timeout_s: float = 10.0) -> None:
    async with asyncio.timeout(timeout_s):
        while not condition():
            await asyncio.sleep(0.02)


@dataclass
class _Client:
    token_ids: list[int]
    asked: list[Any] = field(default_factory=list)
    fail: bool = False

    async def tokenize(self, triton_model: str, task: Any, request_id: str) -> TokenizerResult:
        self.asked.append(task)
        if self.fail:
            raise RuntimeError("tokenizer down")
        return TokenizerResult(self.token_ids, "", 4096)


@dataclass
class _Endpoint:
    client: _Client
    url: str
    outstanding: int = 0

    @property
    def config(self) -> Any:
        return type("Config", (), {"url": self.url})()


@dataclass
class _Profile:
    name: str = "m"
    triton_model: str = "m_triton"


def _routing(holder_blocks: int, prompt: list[int]) -> PrefixRouting:
    """Endpoints a and b publish; b holds the prompt's first `holder_blocks` blocks."""
    feeds = {"a": [KvFeed("tcp://a")], "b": [KvFeed("tcp://b")]}
    feeds["a"][0].apply(TOPIC, 0, encode_batch([kv_events.block_stored([9], None, [5] * 16, 16, None, None)], 1.0))
    if holder_blocks:
        hashes = list(range(100, 100 + holder_blocks))
        feeds["b"][0].apply(TOPIC, 0, encode_batch(
            [kv_events.block_stored(hashes, None, prompt[:16 * holder_blocks], 16, None, None)], 1.0))
    return PrefixRouting(feeds)


def _order(routing: PrefixRouting, endpoints: list[_Endpoint], req: GenerationRequest | None = None) -> list[str]:
    req = req or GenerationRequest(model="m", max_tokens=4, max_tokens_param="max_tokens",
                                   messages=({"role": "user", "content": "hi"},))
    ordered = asyncio.run(routing.order(endpoints, req, _Profile(), None, "rid"))  # type: ignore[arg-type]
    return [e.url for e in ordered]


PROMPT = list(range(3000, 3000 + 16 * 6 + 5))


def test_the_endpoint_holding_the_prompt_goes_first_even_when_busier():
    client = _Client(PROMPT)
    endpoints = [_Endpoint(client, "a", outstanding=0), _Endpoint(client, "b", outstanding=3)]
    assert _order(_routing(6, PROMPT), endpoints) == ["b", "a"]
    (task,) = client.asked  # the chat template's ids, asked of the first candidate
    assert task.messages and task.options["add_generation_prompt"] is True


def test_token_ids_the_client_sent_need_no_tokenize():
    client = _Client([])
    endpoints = [_Endpoint(client, "a"), _Endpoint(client, "b")]
    req = GenerationRequest(model="m", max_tokens=4, max_tokens_param="max_tokens", prompt_token_ids=tuple(PROMPT))
    assert _order(_routing(6, PROMPT), endpoints, req) == ["b", "a"] and not client.asked


@pytest.mark.parametrize("case", ["out of balance", "too little held", "tokenizer fails", "one signal"])
def test_the_load_order_stays_when_the_signal_should_not_win(case):
    client = _Client(PROMPT, fail=case == "tokenizer fails")
    busy = BALANCE_ABS + 5 if case == "out of balance" else 1
    endpoints = [_Endpoint(client, "a", outstanding=0), _Endpoint(client, "b", outstanding=busy)]
    routing = _routing(2 if case == "too little held" else 6, PROMPT)  # 2 of 6 blocks: under half the prompt
    if case == "one signal":
        del routing.feeds["a"]
    assert _order(routing, endpoints) == ["a", "b"]


def test_a_feed_that_cannot_connect_leaves_routing_to_load():
    """Nothing listens at the address: the feed waits, its index stays empty, the order is the router's."""
    async def run() -> list[str]:
        routing = PrefixRouting({"a": [KvFeed("tcp://127.0.0.1:9")], "b": [KvFeed("tcp://127.0.0.1:9")]})
        routing.start()
        try:
            client = _Client(PROMPT)
            endpoints = [_Endpoint(client, "a"), _Endpoint(client, "b")]
            req = GenerationRequest(model="m", max_tokens=4, max_tokens_param="max_tokens", prompt="hi")
            ordered = await routing.order(endpoints, req, _Profile(), None, "rid")  # type: ignore[arg-type]
            return [e.url for e in ordered]
        finally:
            await routing.stop()

    assert asyncio.run(run()) == ["a", "b"]
