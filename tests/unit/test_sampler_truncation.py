"""The sampler's cheap paths equal the plain ones: top-p through the bounded prefilter (and its full-sort fallback)
draws exactly what a full-vocabulary sort draws, and the CPU's sparse penalties equal the dense ones."""

from __future__ import annotations

import pytest
import torch

from engine.sampling.draw import PREFILTER, inverse_cdf
from engine.sampling.sampler import Sampler, penalise_dense, penalise_sparse
from engine.sampling_params import SamplingParams

V = 4 * PREFILTER


class Row:
    def __init__(self, params: SamplingParams, seed: int) -> None:
        self.params, self.generator = params, torch.Generator().manual_seed(seed)
        self.output_ids: list[int] = []
        self.prompt_ids = [1]

    def prompt_mask(self, vocab, device="cpu"):
        return torch.zeros(vocab, dtype=torch.bool, device=device)


def full_sort_draw(logits: torch.Tensor, params: SamplingParams, uniform: float) -> int:
    """The reference: the whole vocabulary sorted, top-k then the nucleus, the CDF in vocabulary order."""
    sub = logits / params.temperature
    values, order = sub.sort(descending=True)
    if 0 < params.top_k < V:
        values[params.top_k:] = float("-inf")
        probs = torch.softmax(values, dim=-1)
    else:
        probs = (values - sub.logsumexp(dim=-1)).exp()
    probs = probs.masked_fill((probs.cumsum(dim=-1) - probs) >= params.top_p, 0.0)
    in_vocab_order = torch.zeros(V).scatter_(0, order, probs)
    return int(inverse_cdf(in_vocab_order[None], torch.tensor([uniform], dtype=torch.float64))[0])


def uniforms(seed: int, n: int) -> list[float]:
    g = torch.Generator().manual_seed(seed)
    return [torch.rand(1, generator=g, dtype=torch.float64).item() for _ in range(n)]


@pytest.mark.parametrize("scale", [2.0, 1.0])  # peaked: the nucleus is within the prefilter; flat: it is not
@pytest.mark.parametrize("top_k", [0, 600])
def test_top_p_draws_equal_a_full_sort(scale, top_k):
    sampler = Sampler(V, set())
    logits = torch.randn(V, generator=torch.Generator().manual_seed(3)) * scale
    params = SamplingParams(temperature=0.9, top_p=0.9, top_k=top_k)
    draws = 40
    rows = [Row(params, seed) for seed in range(draws)]
    got = sampler.sample(logits.repeat(draws, 1), rows).tokens
    want = [full_sort_draw(logits, params, uniforms(seed, 1)[0]) for seed in range(draws)]
    assert got == want
    assert len(set(got)) > 1


def test_a_top_p_row_draws_the_same_beside_rows_that_keep_more_candidates():
    """The prefilter's width follows the batch (a top_k of 900 beside it widens it): the row's tokens must not."""
    sampler = Sampler(V, set())
    logits = torch.randn(3, V, generator=torch.Generator().manual_seed(4)) * 2.0
    nucleus = SamplingParams(temperature=1.0, top_p=0.8, seed=9)
    alone_row = Row(nucleus, 9)
    alone = [sampler.sample(logits[1:2].clone(), [alone_row]).tokens[0] for _ in range(30)]
    batch = [Row(SamplingParams(temperature=1.0, top_k=900), 1), Row(nucleus, 9), Row(SamplingParams(), 2)]
    beside = [sampler.sample(logits.clone(), batch).tokens[1] for _ in range(30)]
    assert beside == alone
    assert len(set(alone)) > 1


def test_sparse_penalties_equal_dense_ones():
    g = torch.Generator().manual_seed(5)
    sub = torch.randn(4, V, generator=g) * 3
    counts = torch.zeros(4, V)
    counts[torch.randint(0, 4, (300,), generator=g), torch.randint(0, V, (300,), generator=g)] += 1.0
    prompt = torch.zeros(4, V, dtype=torch.bool)
    prompt[torch.randint(0, 4, (200,), generator=g), torch.randint(0, V, (200,), generator=g)] = True
    rep, pres, freq = (torch.tensor([[1.3], [1.0], [0.8], [2.0]]), torch.tensor([[0.5], [0.0], [-1.0], [2.0]]),
                       torch.tensor([[0.3], [1.0], [0.0], [-0.5]]))
    for with_prompt in (prompt, None):
        dense = penalise_dense(sub.clone(), counts, with_prompt, rep, pres, freq)
        sparse = penalise_sparse(sub.clone(), counts, with_prompt, rep, pres, freq)
        assert torch.equal(dense, sparse)
        assert not torch.equal(dense, sub)


@pytest.mark.parametrize("top_k", [0, 600])
@pytest.mark.parametrize("top_p", [5e-324, 1e-300, 1e-9])  # valid (> 0); the first two are 0 in the logits' dtype
def test_a_vanishing_top_p_keeps_the_top_token(top_p, top_k):
    """top_p only just above 0 keeps the top token alone: it is drawn, never an index past the candidates."""
    sampler = Sampler(V, set())
    logits = torch.randn(V, generator=torch.Generator().manual_seed(5))
    rows = [Row(SamplingParams(temperature=1.0, top_p=top_p, top_k=top_k), seed) for seed in range(4)]
    assert sampler.sample(logits.repeat(4, 1), rows).tokens == [int(logits.argmax())] * 4
