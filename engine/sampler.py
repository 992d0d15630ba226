"""Vectorised per-row sampler, kept apart from the model forward.

Order per row: logit_bias -> penalties -> min_tokens mask -> grammar mask -> (greedy | temperature,
top_k, top_p, draw with the row's own generator). Logprobs are reported from the raw model
distribution (before any processing), as OpenAI-compatible servers do. Each row draws with its
own `torch.Generator`, so a seeded request samples the same tokens alone or in any batch.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Protocol

import torch

from engine.sampling_params import SamplingParams

LOGPROB_FLOOR = -9999.0  # -inf is not valid JSON; clamp like other OpenAI-compatible servers


class SamplerRow(Protocol):
    """What the sampler needs from a running sequence."""

    params: SamplingParams
    generator: torch.Generator
    output_ids: list[int]
    prompt_ids: list[int]

    def token_counts(self, vocab: int) -> torch.Tensor: ...
    def prompt_mask(self, vocab: int) -> torch.Tensor: ...


GrammarMask = Callable[[torch.Tensor], None]  # applies a row's allowed-token mask in place to [V] logits


@dataclass
class SampleOutput:
    tokens: list[int]
    logprobs: list[float]  # raw logprob of each chosen token
    top: list[list[tuple[int, float]] | None] = field(default_factory=list)


class Sampler:
    def __init__(self, vocab_size: int, stop_token_ids: set[int]) -> None:
        self.vocab_size = vocab_size
        self.stop_token_set = frozenset(stop_token_ids)
        self.stop_ids = torch.tensor(sorted(stop_token_ids), dtype=torch.long)

    @torch.inference_mode()
    def sample(
        self,
        logits: torch.Tensor,
        rows: list[SamplerRow],
        grammar_masks: dict[int, GrammarMask] | None = None,
    ) -> SampleOutput:
        """logits: [B, V] float32 for the B rows (modified in place)."""
        vocab = logits.shape[-1]
        raw_logprobs = torch.log_softmax(logits, dim=-1)
        self._apply_bias_and_penalties(logits, rows, vocab)
        for i, row in enumerate(rows):
            if len(row.output_ids) < row.params.min_tokens and not row.params.ignore_eos or row.params.ignore_eos:
                logits[i, self.stop_ids] = float("-inf")
        for i, apply_mask in (grammar_masks or {}).items():
            apply_mask(logits[i])
        tokens = self._choose(logits, rows)
        chosen = raw_logprobs.gather(1, tokens[:, None])[:, 0].clamp(min=LOGPROB_FLOOR)
        top: list[list[tuple[int, float]] | None] = [None] * len(rows)
        want_top = [i for i, r in enumerate(rows) if r.params.logprobs and r.params.top_logprobs > 0]
        if want_top:
            k = max(rows[i].params.top_logprobs for i in want_top)
            values, ids = raw_logprobs[want_top].topk(k, dim=-1)
            values = values.clamp(min=LOGPROB_FLOOR)
            for j, i in enumerate(want_top):
                kk = rows[i].params.top_logprobs
                top[i] = list(zip(ids[j, :kk].tolist(), values[j, :kk].tolist(), strict=True))
        return SampleOutput(tokens=tokens.tolist(), logprobs=chosen.tolist(), top=top)

    def _apply_bias_and_penalties(self, logits: torch.Tensor, rows: list[SamplerRow], vocab: int) -> None:
        for i, row in enumerate(rows):
            p = row.params
            if p.logit_bias:
                ids = torch.tensor([t for t in p.logit_bias if 0 <= t < vocab], dtype=torch.long)
                vals = torch.tensor([v for t, v in p.logit_bias.items() if 0 <= t < vocab], dtype=logits.dtype)
                logits[i].index_add_(0, ids, vals)
        penalised = [i for i, r in enumerate(rows) if r.params.uses_penalties]
        if not penalised:
            return
        sub = logits[penalised]
        counts = torch.stack([rows[i].token_counts(vocab) for i in penalised])
        rep = torch.tensor([rows[i].params.repetition_penalty for i in penalised])[:, None]
        pres = torch.tensor([rows[i].params.presence_penalty for i in penalised])[:, None]
        freq = torch.tensor([rows[i].params.frequency_penalty for i in penalised])[:, None]
        if (rep != 1.0).any():
            # HF/vLLM definition: over prompt and output tokens, shrink toward zero
            seen = torch.stack([rows[i].prompt_mask(vocab) for i in penalised]) | (counts > 0)
            scaled = torch.where(sub > 0, sub / rep, sub * rep)
            sub = torch.where(seen, scaled, sub)
        # OpenAI definition: over generated tokens only
        sub = sub - freq * counts - pres * (counts > 0).to(sub.dtype)
        logits[penalised] = sub

    def _choose(self, logits: torch.Tensor, rows: list[SamplerRow]) -> torch.Tensor:
        """Greedy rows take the argmax; sampled rows draw by inverse CDF with one uniform from their own
        generator (a vectorised `searchsorted`, far cheaper than a multinomial per row)."""
        tokens = logits.argmax(dim=-1)
        sampled = [i for i, r in enumerate(rows) if not r.params.greedy]
        if not sampled:
            return tokens
        vocab = logits.shape[-1]
        params = [rows[i].params for i in sampled]
        sub = logits[sampled] / torch.tensor([p.temperature for p in params], dtype=logits.dtype)[:, None]
        uniform = torch.cat([torch.rand(1, generator=rows[i].generator) for i in sampled])
        top_ks = torch.tensor([p.top_k if 0 < p.top_k < vocab else vocab for p in params])
        top_ps = torch.tensor([p.top_p for p in params], dtype=logits.dtype)
        uses_top_p = bool((top_ps < 1.0).any())
        if uses_top_p or bool((top_ks < vocab).any()):
            # candidates in descending order: when every row has a top_k, that subset is exact (top_p is
            # taken over the renormalised top-k, as HF and vLLM do); a row without one needs the full sort
            width = int(top_ks.max())
            values, order = sub.sort(dim=-1, descending=True) if width == vocab else sub.topk(width, dim=-1)
            values = values.masked_fill(torch.arange(width)[None, :] >= top_ks[:, None], float("-inf"))
            probs = torch.softmax(values, dim=-1)
            if uses_top_p:
                # keep the smallest prefix whose mass reaches top_p (the top token always survives)
                probs = probs.masked_fill((probs.cumsum(dim=-1) - probs) >= top_ps[:, None], 0.0)
            # back to vocabulary order, so a row's draw never depends on what else is in the batch
            probs = torch.zeros_like(sub).scatter_(1, order, probs)
        else:
            probs = torch.softmax(sub, dim=-1)
        cdf = probs.cumsum(dim=-1)
        picks = torch.searchsorted(cdf, (uniform * cdf[:, -1])[:, None], right=True).clamp(max=vocab - 1)
        tokens[sampled] = picks[:, 0]
        return tokens
