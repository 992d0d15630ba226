"""Vectorised per-row sampler, kept apart from the model forward.

Order per row: logit_bias -> penalties -> grammar mask -> stop-token bans (min_tokens, ignore_eos;
never emptying a row) -> (greedy | temperature,
top_k, top_p, draw with the row's own generator). Logprobs are reported from the raw model
distribution (before any processing), as OpenAI-compatible servers do. Each row draws with its
own `torch.Generator`, so a seeded request samples the same tokens alone or in any batch.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Protocol

import torch

from engine.sampling.penalty_counts import PenaltyCounts
from engine.sampling_params import SamplingParams
from engine.staging import row_index, stage

LOGPROB_FLOOR = -9999.0  # -inf is not valid JSON; clamp like other OpenAI-compatible servers


class SamplerRow(Protocol):
    """What the sampler needs from a running sequence."""

    params: SamplingParams
    generator: torch.Generator
    output_ids: list[int]
    prompt_ids: list[int]

    def prompt_mask(self, vocab: int, device: torch.device | str = ...) -> torch.Tensor: ...


GrammarMask = Callable[[torch.Tensor], None]  # applies a row's allowed-token mask in place to [V] logits


@dataclass
class SampleOutput:
    tokens: list[int]
    logprobs: list[float]  # raw logprob of each chosen token
    top: list[list[tuple[int, float]] | None] = field(default_factory=list)
    row_errors: dict[int, Exception] = field(default_factory=dict)  # rows whose own settings failed; drop them


class Sampler:
    def __init__(self, vocab_size: int, stop_token_ids: set[int]) -> None:
        self.vocab_size = vocab_size
        self.stop_token_set = frozenset(stop_token_ids)
        self.stop_ids = sorted(stop_token_ids)
        self.counts = PenaltyCounts()  # output-token counts of penalised rows, on the logits' device

    @torch.inference_mode()
    def sample(
        self,
        logits: torch.Tensor,
        rows: Sequence[SamplerRow],
        grammar_masks: dict[int, GrammarMask] | None = None,
    ) -> SampleOutput:
        """logits: [B, V] float32 for the B rows (modified in place), on any device.

        Every tensor is made on the logits' device (host lists are staged without a sync, see
        engine.staging); the chosen ids, their logprobs and any top logprobs cross to the host in one
        transfer, the step's only sync.
        """
        vocab = logits.shape[-1]
        raw_logprobs = torch.log_softmax(logits, dim=-1)
        row_errors: dict[int, Exception] = {}
        self._apply_bias_and_penalties(logits, rows, vocab, row_errors)
        for i, apply_mask in (grammar_masks or {}).items():
            try:
                apply_mask(logits[i])
            except Exception as exc:  # one request's grammar must not fail the batch
                row_errors[i] = exc
        for i in row_errors:
            logits[i] = 0.0  # a failed row still gets a (discarded) draw; keep it finite
        self._mask_stop_tokens(logits, rows)
        tokens = self._choose(logits, rows)
        chosen = raw_logprobs.gather(1, tokens[:, None])[:, 0].clamp(min=LOGPROB_FLOOR)
        b = len(rows)
        parts = [tokens.double(), chosen.double()]  # float64 holds every token id exactly
        want_top = [i for i, r in enumerate(rows) if r.params.logprobs and r.params.top_logprobs > 0]
        k = max((rows[i].params.top_logprobs for i in want_top), default=0)
        if want_top:
            top_values, top_index = raw_logprobs[row_index(want_top, b, logits.device)].topk(k, dim=-1)
            parts += [top_index.double().flatten(), top_values.clamp(min=LOGPROB_FLOOR).double().flatten()]
        host = torch.cat(parts).tolist()  # the one device -> host transfer of the step
        ids, logprobs = host[:b], host[b : 2 * b]
        top: list[list[tuple[int, float]] | None] = [None] * b
        n_top = len(want_top) * k
        top_ids, values = host[2 * b : 2 * b + n_top], host[2 * b + n_top :]
        for j, i in enumerate(want_top):
            kk = rows[i].params.top_logprobs
            top[i] = [(int(t), v) for t, v in zip(top_ids[j * k : j * k + kk], values[j * k : j * k + kk],
                                                    strict=True)]
        return SampleOutput(tokens=[int(t) for t in ids], logprobs=logprobs, top=top, row_errors=row_errors)

    def _mask_stop_tokens(self, logits: torch.Tensor, rows: Sequence[SamplerRow]) -> None:
        """min_tokens bans EOS and the request's stop ids until reached; ignore_eos bans EOS. A ban never
        empties a row: when a grammar allows nothing but the end, the candidate ends (finish `stop`)."""
        early = [len(r.output_ids) < r.params.min_tokens for r in rows]
        banned_rows = [i for i, r in enumerate(rows) if early[i] or r.params.ignore_eos]
        if not banned_rows:
            return
        vocab, device = logits.shape[-1], logits.device
        # the (row, token) pairs to ban cross to the device in one small copy; the mask is made there
        pairs: list[tuple[int, int]] = []
        for j, i in enumerate(banned_rows):
            extra = rows[i].params.stop_token_ids if early[i] else []
            pairs += [(j, t) for t in {*self.stop_ids, *extra} if 0 <= t < vocab]
        ban = torch.zeros(len(banned_rows), vocab, dtype=torch.bool, device=device)
        if pairs:
            where = stage(pairs, torch.long, device)
            ban[where[:, 0], where[:, 1]] = True
        index = row_index(banned_rows, len(rows), device)
        sub = logits[index]
        kept = sub.masked_fill(ban, float("-inf"))
        logits[index] = torch.where(torch.isfinite(kept).any(dim=-1, keepdim=True), kept, sub)

    def _apply_bias_and_penalties(self, logits: torch.Tensor, rows: Sequence[SamplerRow], vocab: int,
                                  row_errors: dict[int, Exception]) -> None:
        device = logits.device
        # every row's bias in one staged (row, token, value) table and one scatter-add
        bias: list[tuple[int, int, float]] = []
        for i, row in enumerate(rows):
            try:
                bias += [(i, int(t), float(v)) for t, v in row.params.logit_bias.items() if 0 <= t < vocab]
            except Exception as exc:
                row_errors[i] = exc
        if bias:
            table = stage(bias, torch.float64, device)  # ids < 2**53 are exact in float64
            logits.index_put_((table[:, 0].long(), table[:, 1].long()), table[:, 2].to(logits.dtype),
                              accumulate=True)
        penalised = [i for i, r in enumerate(rows) if r.params.uses_penalties]
        if not penalised:
            return
        index = row_index(penalised, len(rows), device)
        sub = logits[index]
        counts = self.counts.gather([rows[i] for i in penalised], vocab, logits.dtype, device)
        settings = stage([[rows[i].params.repetition_penalty, rows[i].params.presence_penalty,
                           rows[i].params.frequency_penalty] for i in penalised], logits.dtype, device)
        rep, pres, freq = settings[:, 0:1], settings[:, 1:2], settings[:, 2:3]
        if any(rows[i].params.repetition_penalty != 1.0 for i in penalised):
            # HF/vLLM definition: over prompt and output tokens, shrink toward zero
            seen = torch.stack([rows[i].prompt_mask(vocab, device) for i in penalised]) | (counts > 0)
            scaled = torch.where(sub > 0, sub / rep, sub * rep)
            sub = torch.where(seen, scaled, sub)
        # OpenAI definition: over generated tokens only
        sub = sub - freq * counts - pres * (counts > 0).to(sub.dtype)
        logits[index] = sub

    def _choose(self, logits: torch.Tensor, rows: Sequence[SamplerRow]) -> torch.Tensor:
        """Greedy rows take the argmax; sampled rows draw by inverse CDF with one uniform from their own
        generator (a vectorised `searchsorted`, far cheaper than a multinomial per row). The uniforms
        are drawn on the host from each row's own generator, so a seeded row draws the same alone, in
        any batch and on any device."""
        tokens = logits.argmax(dim=-1)
        sampled = [i for i, r in enumerate(rows) if not r.params.greedy]
        if not sampled:
            return tokens
        device = logits.device
        vocab = logits.shape[-1]
        params = [rows[i].params for i in sampled]
        # one uniform per row from its own host generator, staged with the row settings in one copy
        draws = [torch.rand(1, generator=rows[i].generator, dtype=torch.float64, device="cpu").item()
                 for i in sampled]
        settings = stage([[p.temperature, p.top_p, p.top_k if 0 < p.top_k < vocab else vocab, u]
                          for p, u in zip(params, draws, strict=True)], torch.float64, device)
        temps, top_ps = settings[:, 0:1].to(logits.dtype), settings[:, 1].to(logits.dtype)
        top_ks, uniform = settings[:, 2].long(), settings[:, 3]
        index = row_index(sampled, len(rows), device)
        sub = logits[index] / temps
        uses_top_p = any(p.top_p < 1.0 for p in params)
        width = max(p.top_k if 0 < p.top_k < vocab else vocab for p in params)
        if uses_top_p or width < vocab:
            # candidates in descending order: when every row has a top_k, that subset is exact (top_p is
            # taken over the renormalised top-k, as HF and vLLM do); a row without one needs the full sort
            values, order = sub.sort(dim=-1, descending=True) if width == vocab else sub.topk(width, dim=-1)
            values = values.masked_fill(torch.arange(width, device=device)[None, :] >= top_ks[:, None],
                                        float("-inf"))
            probs = torch.softmax(values, dim=-1)
            if uses_top_p:
                # keep the smallest prefix whose mass reaches top_p (the top token always survives)
                probs = probs.masked_fill((probs.cumsum(dim=-1) - probs) >= top_ps[:, None], 0.0)
            # back to vocabulary order, so a row's draw never depends on what else is in the batch
            probs = torch.zeros_like(sub).scatter_(1, order, probs)
        else:
            probs = torch.softmax(sub, dim=-1)
        tokens[index] = _inverse_cdf(probs, uniform)
        return tokens


def _inverse_cdf(probs: torch.Tensor, uniform: torch.Tensor) -> torch.Tensor:
    """[B] tokens for [B, V] probabilities and [B] float64 uniforms in [0, 1); never a zero-probability token.

    The first index whose cumulative mass exceeds the target has positive probability as long as the target
    lies below the total. In the logits' dtype the uniform itself can round to 1.0 (about 3e-8 of float32
    draws), so the CDF is summed in float64 and the target kept strictly below the row's total.
    """
    cdf = probs.to(torch.float64).cumsum(dim=-1)
    total = cdf[:, -1]
    target = torch.minimum(uniform * total, torch.nextafter(total, torch.zeros_like(total)))
    return torch.searchsorted(cdf, target[:, None], right=True)[:, 0]
