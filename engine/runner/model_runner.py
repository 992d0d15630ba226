"""The model runner: host inputs in, logits out, over the model's KV cache, adapters and CUDA graphs.

It owns everything a forward needs besides the weights: the paged KV cache (rows are the scheduler's slots, whose
block tables the scheduler fills before a forward writes there), the LoRA adapter table, and the decode CUDA
graphs. It picks how a decode step runs: replayed from a graph when graphs are on and no row uses an adapter,
eagerly otherwise (or when no graph fits), as nano-vllm's `ModelRunner.run_model` does. The decoder stays pure
model math.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from engine.model.decoder import Decoder
from engine.model.kv_cache import KVCache
from engine.model.selection import AnyDecoder
from engine.runner.cuda_graphs import DecodeGraphs
from engine.staging import stage


@dataclass
class Span:
    """Part of one sequence's prompt (or tokens being recomputed) that a step's forward prefills."""

    slot: int
    tokens: list[int]
    start: int  # the position of tokens[0]
    sample: bool  # the logits of its last token are wanted (the span ends a new prompt)
    adapter: str | None = None
    embeds: torch.Tensor | None = None  # input embeddings that replace the tokens' (an image request's prompt)


class ModelRunner:
    def __init__(self, decoder: AnyDecoder, slots: int, max_len: int, adapters: dict[str, Any] | None = None,
                 cuda_graphs: bool = False, capture: bool | None = None, kv_blocks: int | None = None,
                 kv_dtype: str = "auto") -> None:
        """`cuda_graphs`: replay decode steps from graphs (`capture=False` runs the same padded, bucketed
        step eagerly, which is how the CPU tests check it; None: capture on CUDA). `kv_blocks`: the KV pool's
        blocks, the null block included (None: every slot's whole context). `kv_dtype`: the profile's
        `kv_cache_dtype`."""
        self.decoder = decoder
        self.device = decoder.device
        self.cache: KVCache = decoder.new_cache(slots, max_len, kv_blocks, kv_dtype)
        # served adapter name -> what the decoder's LoRA rows need (engine.model.lora, .transformers_lora)
        self.adapters: dict[str, Any] = adapters if adapters is not None else {}
        self.graphs = DecodeGraphs(self._graph_step, slots, max_len, self.cache.max_blocks, decoder.hidden_size,
                                   decoder.dtype, decoder.device, capture) if cuda_graphs else None

    @property
    def vocab_size(self) -> int:
        return self.decoder.vocab_size

    def _lora(self, token_adapters: list[str | None]):
        """The decoder's LoRA rows for one forward (an adapter per row of its activations), None without any."""
        return self.decoder.lora_batch(self.adapters, token_adapters) if any(token_adapters) else None

    def prefill(self, slot: int, token_ids: list[int], start: int, adapter: str | None = None,
                embeds: torch.Tensor | None = None) -> torch.Tensor:
        """Run `token_ids` for one slot from position `start`; returns logits of the last token [V]."""
        logits = self._prefill(slot, token_ids, start, adapter, embeds, sample=True)
        assert logits is not None
        return logits

    def prefill_part(self, slot: int, token_ids: list[int], start: int, adapter: str | None = None,
                     embeds: torch.Tensor | None = None) -> None:
        """`prefill` of a chunk that does not end its prompt: K/V only, no LM head (nothing samples from it)."""
        self._prefill(slot, token_ids, start, adapter, embeds, sample=False)

    def _prefill(self, slot: int, token_ids: list[int], start: int, adapter: str | None, embeds: torch.Tensor | None,
                 sample: bool) -> torch.Tensor | None:
        lora = self._lora([adapter] * len(token_ids)) if adapter else None  # every token runs on the adapter
        return self.decoder.prefill(self.cache, slot, token_ids, start, lora, embeds, sample)

    def prefill_batch(self, slots: list[int], prompts: list[list[int]], adapters: list[str | None],
                      starts: list[int] | None = None) -> torch.Tensor:
        """The prompts of several new sequences in one forward; returns [k, V] last logits. `starts`: the
        positions each slot already holds (a cached prefix), which `prompts` continue; None: whole prompts."""
        lora = self._lora(self.decoder.batch_token_adapters(prompts, adapters)) if any(adapters) else None
        return self.decoder.prefill_batch(self.cache, slots, prompts, starts=starts, lora=lora)

    def step(self, tokens: list[int], positions: list[int], adapters: list[str | None], spans: list[Span]
             ) -> torch.Tensor:
        """One engine step: decode rows 0..B-1 (row i feeds `tokens[i]` at `positions[i]`) and prefill `spans`.
        Returns [B + S, V] logits: the decode rows', then the last token's of each of the S spans that sample.
        Under our attention kernels it is one forward (the weights are read once for the step); otherwise the
        decode rows and the spans run as the forwards they have alone (CUDA graphs, the padded SDPA batch)."""
        if not spans:
            return self.decode(tokens, positions, adapters)
        if isinstance(self.decoder, Decoder) and self.decoder.native_attention:
            token_adapters = adapters + [s.adapter for s in spans for _ in s.tokens]
            embeds: list[torch.Tensor | None] = [None] * len(tokens)
            embeds += [s.embeds for s in spans]
            return self.decoder.forward_packed(
                self.cache, list(range(len(tokens))) + [s.slot for s in spans],
                [[t] for t in tokens] + [s.tokens for s in spans], positions + [s.start for s in spans],
                decode=len(tokens), sample=[True] * len(tokens) + [s.sample for s in spans],
                lora=self._lora(token_adapters), embeds=embeds)
        parts = [self.decode(tokens, positions, adapters)] if tokens else []
        if len(spans) > 1 and all(s.sample and s.embeds is None for s in spans):  # whole short prompts
            parts.append(self.prefill_batch([s.slot for s in spans], [s.tokens for s in spans],
                                            [s.adapter for s in spans], starts=[s.start for s in spans]))
        else:
            for s in spans:
                logits = self._prefill(s.slot, s.tokens, s.start, s.adapter, s.embeds, sample=s.sample)
                if logits is not None:
                    parts.append(logits[None])
        if not parts:
            return torch.empty(0, self.vocab_size, device=self.device)
        return torch.cat(parts) if len(parts) > 1 else parts[0]

    @torch.inference_mode()
    def decode(self, token_ids: list[int], positions: list[int], adapters: list[str | None] | None = None
               ) -> torch.Tensor:
        """One step for slots 0..B-1 (row i feeds `token_ids[i]` at `positions[i]`). Returns [B, V] logits."""
        with_lora = bool(adapters and any(adapters))
        if self.graphs is not None and not with_lora:
            hidden = self.graphs.run(token_ids, positions, self.cache.device_tables(0, len(token_ids)))
            if hidden is not None:
                return self.decoder.logits(hidden)  # the LM head outside the graph, on the live rows only
        inputs = stage([token_ids, positions], torch.long, self.device)  # one host->device copy
        lora = self._lora(adapters) if adapters and with_lora else None
        # every row at the same position attends to the whole span: no mask to build or read
        full = min(positions) == max(positions)
        hidden = self.decoder.decode_hidden(self.cache, inputs[0], inputs[1], max(positions) + 1, lora,
                                            masked=not full)
        return self.decoder.logits(hidden)

    def _graph_step(self, tokens: torch.Tensor, positions: torch.Tensor, tables: torch.Tensor, span: int
                    ) -> torch.Tensor:
        return self.decoder.decode_hidden(self.cache, tokens, positions, span, tables=tables)
