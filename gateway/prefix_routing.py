"""Send a request where its prompt's leading blocks already are, unless that would pile work on one endpoint.

The signal is each engine's KV events (gateway/kv_blocks.py), for endpoints whose routing entry lists their
publishers (`kv_events`, docs/deploy.md). The policy is SGLang's cache-aware router's:
- when the endpoints' loads are out of balance (the busiest runs more than `BALANCE_ABS` requests more than the
  idlest, and more than `BALANCE_REL` times as many), the least loaded goes first, as without the signal;
- otherwise the endpoint holding the most of the prompt's leading blocks goes first, when that is at least
  `MIN_MATCH` of the prompt; the rest follow by load.
A request with an affinity key (`routing_key`, `prompt_cache_key`) keeps its rendezvous order: the client chose.

To match blocks the gateway needs the prompt's token ids: one tokenize request to the first candidate's model (the
chat template, as generation applies it), only when two or more candidates have a signal. If that fails or takes
longer than `TOKENIZE_TIMEOUT_S`, the order stays as it was: the signal can only help a request, never fail it.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Sequence
from typing import Any

from gateway.domain import GenerationRequest, TokenizerTask
from gateway.endpoint import Endpoint
from gateway.kv_blocks import KvFeed, request_root
from gateway.profile import ModelProfile
from gateway.settings import Settings

log = logging.getLogger(__name__)

BALANCE_ABS = 8
BALANCE_REL = 1.5
MIN_MATCH = 0.5
TOKENIZE_TIMEOUT_S = 1.0


def tokenizer_task(req: GenerationRequest) -> TokenizerTask:
    """The ids generation will see (the same options as `/tokenize` with the request's chat fields)."""
    if req.messages is None:
        return TokenizerTask(prompt=req.prompt or "", options={"add_special_tokens": True})
    options: dict[str, Any] = {"add_special_tokens": False, "add_generation_prompt": True,
                               "continue_final_message": False}
    if req.chat_template_kwargs:
        options["chat_template_kwargs"] = dict(req.chat_template_kwargs)
    if req.tools:
        options["tools"] = list(req.tools)
    return TokenizerTask(messages=req.messages, options=options)


def out_of_balance(loads: Sequence[int]) -> bool:
    busiest, idlest = max(loads), min(loads)
    return busiest - idlest > BALANCE_ABS and busiest > idlest * BALANCE_REL


class PrefixRouting:
    def __init__(self, feeds: dict[str, list[KvFeed]]) -> None:
        self.feeds = feeds  # endpoint url -> its models' publishers

    @classmethod
    def from_settings(cls, settings: Settings) -> PrefixRouting:
        feeds: dict[str, list[KvFeed]] = {}
        for pool in settings.pools:
            for endpoint in pool.endpoints:
                if endpoint.kv_events:
                    feeds.setdefault(endpoint.url, []).extend(KvFeed(events, replay)
                                                              for events, replay in endpoint.kv_events)
        return cls(feeds)

    def start(self) -> None:
        for feeds in self.feeds.values():
            for feed in feeds:
                feed.start()

    async def stop(self) -> None:
        await asyncio.gather(*(feed.stop() for feeds in self.feeds.values() for feed in feeds))

    def held_blocks(self, endpoint: Endpoint, model: str, root: tuple[Any, ...], token_ids: Sequence[int]) -> int:
        indexes = [feed.index(model) for feed in self.feeds.get(endpoint.config.url, ())]
        return max((index.leading_blocks(root, token_ids) for index in indexes if index is not None), default=0)

    def block_size(self, model: str) -> int:
        return max((index.block_size for feeds in self.feeds.values() for feed in feeds
                    if (index := feed.index(model)) is not None), default=0)

    async def order(self, endpoints: list[Endpoint], req: GenerationRequest, profile: ModelProfile,
                    cache_salt: str | None, request_id: str) -> list[Endpoint]:
        """`endpoints` (best first, by load or affinity), reordered by the blocks each holds where that helps."""
        signalled = sum(1 for e in endpoints if self.feeds.get(e.config.url))
        block_size = self.block_size(profile.name)
        if signalled < 2 or not block_size or req.images or out_of_balance([e.outstanding for e in endpoints]):
            return endpoints
        token_ids: Sequence[int] | None = req.prompt_token_ids
        if token_ids is None:
            try:
                async with asyncio.timeout(TOKENIZE_TIMEOUT_S):
                    result = await endpoints[0].client.tokenize(profile.triton_model, tokenizer_task(req), request_id)
            except Exception as exc:  # the signal is a hint: without the ids, route by load alone
                log.debug("no prompt ids for prefix routing: %s", exc)
                return endpoints
            token_ids = result.token_ids
        root = request_root(req.lora_adapter, cache_salt)
        held = {id(e): self.held_blocks(e, profile.name, root, token_ids) for e in endpoints}
        best = max(endpoints, key=lambda e: held[id(e)])
        if held[id(best)] * block_size < MIN_MATCH * len(token_ids):
            return endpoints
        return [best] + [e for e in endpoints if e is not best]
