"""Each row's token from its processed logits: the argmax for greedy rows, one inverse-CDF draw for the others.

A sampled row draws one uniform from its own host generator (staged with its settings in one copy), so a seeded
row draws the same alone, in any batch and on any device; the draw is a vectorised `searchsorted`, far cheaper
than a multinomial per row.

Truncation without a full-vocabulary sort. A row with `top_k` keeps its k best (top_p is then taken over the
renormalised top-k, as HF and vLLM do). A row with `top_p` and no `top_k` is first cut to its `PREFILTER` best
candidates, the bounded top-k prefilter of vLLM's and FlashInfer's samplers: when those candidates hold at least
`top_p` of the row's mass, the nucleus lies among them and the cut is exact. A row whose candidates hold less (a
very flat distribution) takes the full sort, so the nucleus is exact either way. That check reads one flag on the
host: on a GPU it is one more sync, and only when such a row is in the step.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from engine.sampling import row_ops
from engine.sampling_params import SamplingParams
from engine.staging import row_index, stage

PREFILTER = 256  # candidates kept before the nucleus of a row with top_p and no top_k


def choose(logits: torch.Tensor, rows: Sequence) -> torch.Tensor:
    """[B] token ids for [B, V] processed logits; `rows[i].params` and `rows[i].generator` say how."""
    tokens = row_ops.argmax(logits)
    sampled = [i for i, r in enumerate(rows) if not r.params.greedy]
    if not sampled:
        return tokens
    device, vocab = logits.device, logits.shape[-1]
    params = [rows[i].params for i in sampled]
    draws = [torch.rand(1, generator=rows[i].generator, dtype=torch.float64, device="cpu").item() for i in sampled]
    settings = stage([[p.temperature, p.top_p if p.top_p < 1.0 else float("inf"), _top_k(p, vocab), u]
                      for p, u in zip(params, draws, strict=True)], torch.float64, device)
    # the rows unscaled (a view when every row samples): temperature divides only what each draw reads
    raw = logits[row_index(sampled, len(rows), device)]
    truncated = [j for j, p in enumerate(params) if p.top_p < 1.0 or _top_k(p, vocab) < vocab]
    plain = [j for j in range(len(params)) if j not in set(truncated)]
    picks = torch.empty(len(params), dtype=torch.long, device=device)
    if plain:
        index = row_index(plain, len(params), device)
        picks[index] = inverse_cdf(torch.softmax(_scaled(raw[index], settings[index]), dim=-1), settings[index, 3])
    if truncated:
        index = row_index(truncated, len(params), device)
        picks[index] = _draw_truncated(raw[index], [params[j] for j in truncated], settings[index])
    tokens[row_index(sampled, len(rows), device)] = picks
    return tokens


def _scaled(logits: torch.Tensor, settings: torch.Tensor) -> torch.Tensor:
    """[S, W] logits over each row's temperature (settings[:, 0])."""
    return logits / settings[:, 0:1].to(logits.dtype)


def _top_k(p: SamplingParams, vocab: int) -> int:
    return p.top_k if 0 < p.top_k < vocab else vocab


def _draw_truncated(raw: torch.Tensor, params: list[SamplingParams], settings: torch.Tensor) -> torch.Tensor:
    """[S] tokens for rows that truncate (top-k and/or top-p), drawn over their candidates only.

    `raw` is unscaled: a positive temperature keeps every row's order, so the candidates are taken first and only
    their values divided, the same quotients as dividing the whole row (a row without top_k divides its whole
    row once more, for the normaliser of its nucleus)."""
    vocab = raw.shape[-1]
    has_k = [_top_k(p, vocab) < vocab for p in params]
    width = max([_top_k(p, vocab) for p, k in zip(params, has_k, strict=True) if k]
                + ([] if all(has_k) else [min(PREFILTER, vocab)]))
    values, order = row_ops.topk(raw, width)
    values = _scaled(values, settings)
    full_lse = None
    if not all(has_k):
        without_k = [j for j, k in enumerate(has_k) if not k]
        index = row_index(without_k, len(params), raw.device)
        full_lse = torch.zeros(len(params), dtype=values.dtype, device=raw.device)
        full_lse[index] = row_ops.logsumexp(_scaled(raw[index], settings[index]))
    probs, short = _nucleus(values, settings, has_k, full_lse)
    picks = _draw_in_vocab_order(probs, order, settings[:, 3])
    if short is not None and bool(short.any()):
        rows = short.nonzero()[:, 0]
        values, order = _scaled(raw[rows], settings[rows]).sort(dim=-1, descending=True)
        flags = [has_k[i] for i in rows.tolist()]
        probs, _ = _nucleus(values, settings[rows], flags, full_lse[rows] if full_lse is not None else None)
        picks[rows] = _draw_in_vocab_order(probs, order, settings[rows, 3])
    return picks


def _draw_in_vocab_order(probs: torch.Tensor, ids: torch.Tensor, uniform: torch.Tensor) -> torch.Tensor:
    """The draw over candidates `ids` [S, W] with `probs`, taken in vocabulary order: the same sums, in the same
    order, as over the whole vocabulary with zeros elsewhere, so a row's draw never depends on how many
    candidates its batch kept (nor on how ties were ordered)."""
    ids, perm = ids.sort(dim=-1)
    return ids.gather(1, inverse_cdf(probs.gather(1, perm), uniform)[:, None])[:, 0]


def _nucleus(values: torch.Tensor, settings: torch.Tensor, has_k: list[bool], full_lse: torch.Tensor | None
             ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Probabilities of the descending candidates `values` [S, W] after top-k and top-p, and (when a row has no
    top_k) which rows' W candidates hold less than their top_p: those need all V candidates."""
    device = values.device
    top_ps, top_ks = settings[:, 1].to(values.dtype), settings[:, 2].long()
    values = values.masked_fill(torch.arange(values.shape[-1], device=device)[None, :] >= top_ks[:, None],
                                float("-inf"))
    if full_lse is None:  # every row renormalises over its own top-k
        probs = torch.softmax(values, dim=-1)
        short = None
    else:  # rows without a top_k keep their mass in the whole vocabulary
        with_k = stage(has_k, torch.bool, device)
        norm = torch.where(with_k, values.logsumexp(dim=-1), full_lse)
        probs = (values - norm[:, None]).exp()
        short = ~with_k & (probs.sum(dim=-1) < top_ps)
    # keep the smallest prefix whose mass reaches top_p; the top token always survives, also when top_p (valid when
    # above 0) is 0 in the logits' dtype (5e-324 is in float32), which would otherwise mask every candidate
    drop = (probs.cumsum(dim=-1) - probs) >= top_ps[:, None]
    drop[:, 0] = False
    probs = probs.masked_fill(drop, 0.0)
    return probs, short


def inverse_cdf(probs: torch.Tensor, uniform: torch.Tensor) -> torch.Tensor:
    """[B] tokens for [B, V] probabilities and [B] float64 uniforms in [0, 1); never a zero-probability token.

    The first index whose cumulative mass exceeds the target has positive probability as long as the target
    lies below the total. In the logits' dtype the uniform itself can round to 1.0 (about 3e-8 of float32
    draws), so the CDF is summed in float64 and the target kept strictly below the row's total.
    """
    cdf = probs.to(torch.float64).cumsum(dim=-1)
    total = cdf[:, -1]
    target = torch.minimum(uniform * total, torch.nextafter(total, torch.zeros_like(total)))
    return torch.searchsorted(cdf, target[:, None], right=True)[:, 0]
