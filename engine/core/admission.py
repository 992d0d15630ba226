"""Request checks at admission: what the engine refuses at once, with the error the client sees.

Only what could never run is refused: an empty prompt, a prompt past the context, an unknown adapter, more
candidates than rows, a client's own `max_tokens` past the context, and KV memory that even alone it could never
have (docs/kv-memory.md). Anything smaller is queued and runs, preempted and recomputed if need be.
"""

from __future__ import annotations

from collections.abc import Container

from engine.core.kv_manager import blocks
from engine.core.sequence import SequenceGroup
from engine.errors import EngineError
from engine.request import EngineRequest


def check_request(request: EngineRequest, max_len: int, max_slots: int, adapters: Container[str]) -> None:
    """Refuse what this engine cannot run; a default `max_tokens` past the context is clamped to it."""
    params = request.params
    prompt_len = len(request.prompt_ids)
    if prompt_len == 0:
        raise EngineError("invalid_request", "prompt is empty", request.prompt_param)
    if prompt_len >= max_len:
        raise EngineError("context_exceeded", f"prompt has {prompt_len} tokens; this model accepts at most "
                          f"{max_len - 1}", request.prompt_param)
    adapter = params.lora_adapter
    if adapter is not None and adapter not in adapters:
        raise EngineError("unknown_lora_adapter", f"unknown LoRA adapter '{adapter}'", "lora_adapter")
    if params.width > max_slots:
        raise EngineError("invalid_request", f"n/best_of of {params.width} exceeds this engine's {max_slots} "
                          "concurrent sequences", "best_of" if params.best_of else "n")
    room = max_len - prompt_len
    if params.max_tokens > room:
        if not params.clamp_max_tokens:  # the client's own cap: say so, as vLLM and OpenAI do
            raise EngineError("context_exceeded", f"the prompt ({prompt_len} tokens) plus "
                              f"'{params.max_tokens_param}' ({params.max_tokens}) exceeds this model's context of "
                              f"{max_len} tokens", params.max_tokens_param)
        params.max_tokens = room  # a default cap: generation never runs past the cache
        params.min_tokens = min(params.min_tokens, room)


def check_kv_room(group: SequenceGroup, budget_blocks: int, kv_budget: int, max_len: int) -> None:
    """Refuse only what could never run on this engine even alone: its prompt with every candidate's room to grow
    (the candidates share the prompt's full blocks; each copies a partly filled last one), or one candidate at its
    longest."""
    params, prompt_len = group.params, len(group.request.prompt_ids)
    longest = min(prompt_len + params.max_tokens, max_len)
    if blocks(longest) + 1 > budget_blocks:
        raise EngineError("invalid_request", f"the prompt plus '{params.max_tokens_param}' ({longest} token "
                          f"positions) exceeds this engine's KV memory of {kv_budget} token positions",
                          params.max_tokens_param)
    if blocks(prompt_len + 1) + 2 * params.width - 1 > budget_blocks:
        raise EngineError("invalid_request", f"n/best_of ({params.width}) candidates of a {prompt_len}-token prompt "
                          f"exceed this engine's KV memory of {kv_budget} token positions; lower n/best_of or "
                          "shorten the prompt", "best_of" if params.best_of else "n")
