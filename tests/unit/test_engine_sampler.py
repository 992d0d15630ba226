"""Sampler rules one by one, on small synthetic logits and fake rows (no model needed)."""

from __future__ import annotations

import math

import pytest
import torch

from engine.sampling.sampler import LOGPROB_FLOOR, Sampler
from engine.sampling_params import SamplingParams

V = 10
EOS = 0


class FakeRow:
    """The SamplerRow protocol, nothing more."""

    def __init__(self, params: SamplingParams, output_ids=(), prompt_ids=(1,), seed: int = 0) -> None:
        self.params = params
        self.generator = torch.Generator().manual_seed(seed)
        self.output_ids = list(output_ids)
        self.prompt_ids = list(prompt_ids)

    def prompt_mask(self, vocab: int, device: torch.device | str = "cpu") -> torch.Tensor:
        mask = torch.zeros(vocab, dtype=torch.bool, device=device)
        mask[self.prompt_ids] = True
        return mask


def greedy(**kw) -> SamplingParams:
    return SamplingParams(temperature=0.0, **kw)


@pytest.fixture
def sampler() -> Sampler:
    return Sampler(V, {EOS})


def base_logits(rows: int = 1) -> torch.Tensor:
    # distinct values, token 3 is the argmax, token 7 the runner-up, a mix of signs
    row = torch.tensor([0.5, -1.0, 2.0, 4.0, -0.5, 1.0, -2.0, 3.5, 0.0, -3.0])
    return row.repeat(rows, 1)


def test_greedy_is_argmax(sampler):
    logits = torch.randn(5, V, generator=torch.Generator().manual_seed(1))
    out = sampler.sample(logits.clone(), [FakeRow(greedy()) for _ in range(5)])
    assert out.tokens == logits.argmax(-1).tolist()


def test_logit_bias_minus_100_bans_a_token(sampler):
    out = sampler.sample(base_logits(), [FakeRow(greedy(logit_bias={3: -100.0}))])
    assert out.tokens == [7]
    # sampled at temperature 1 the banned token never appears
    rows = [FakeRow(SamplingParams(temperature=1.0, logit_bias={3: -100.0}), seed=s) for s in range(200)]
    out = sampler.sample(base_logits(200), rows)
    assert 3 not in out.tokens


def test_logit_bias_plus_100_forces_a_token(sampler):
    out = sampler.sample(base_logits(), [FakeRow(greedy(logit_bias={9: 100.0}))])
    assert out.tokens == [9]
    rows = [FakeRow(SamplingParams(temperature=1.0, logit_bias={9: 100.0}), seed=s) for s in range(100)]
    assert set(sampler.sample(base_logits(100), rows).tokens) == {9}


def test_logit_bias_out_of_vocab_ids_are_ignored(sampler):
    out = sampler.sample(base_logits(), [FakeRow(greedy(logit_bias={V + 5: 100.0, -1: 100.0}))])
    assert out.tokens == [3]


def test_presence_and_frequency_penalties_follow_openai(sampler):
    """OpenAI: logit[j] - count[j] * frequency_penalty - (count[j] > 0) * presence_penalty, generated tokens only."""
    output_ids = [3, 3, 7, 2, 3]
    prompt_ids = [5, 6]  # prompt tokens are not penalised by presence/frequency
    params = greedy(presence_penalty=0.7, frequency_penalty=0.4)
    logits = base_logits()
    raw = logits.clone()
    sampler.sample(logits, [FakeRow(params, output_ids, prompt_ids)])
    counts = torch.zeros(V)
    for t in output_ids:
        counts[t] += 1
    expected = raw - 0.4 * counts - 0.7 * (counts > 0).float()
    torch.testing.assert_close(logits, expected)
    assert logits[0, 5] == raw[0, 5] and logits[0, 6] == raw[0, 6]


def test_negative_penalties_encourage_repetition(sampler):
    logits = base_logits()
    raw = logits.clone()
    sampler.sample(logits, [FakeRow(greedy(presence_penalty=-1.0, frequency_penalty=-0.5), [9, 9])])
    assert logits[0, 9].item() == pytest.approx(raw[0, 9].item() + 1.0 + 2 * 0.5)


def test_repetition_penalty_follows_hf(sampler):
    """HF: tokens seen in prompt or output: positive logits divided by the penalty, negative ones multiplied."""
    output_ids = [3, 1]
    prompt_ids = [7, 6]
    logits = base_logits()
    raw = logits.clone()
    out = sampler.sample(logits, [FakeRow(greedy(repetition_penalty=2.0), output_ids, prompt_ids)])
    expected = raw.clone()
    for t in (3, 1, 7, 6):
        expected[0, t] = raw[0, t] / 2.0 if raw[0, t] > 0 else raw[0, t] * 2.0
    torch.testing.assert_close(logits, expected)
    assert out.tokens == [2]  # 3 -> 2.0 and 7 -> 1.75 fall below the untouched 2.0 of token 2 (first max)


def test_min_tokens_masks_eos_until_reached(sampler):
    logits = base_logits()
    logits[0, EOS] = 10.0
    params = greedy(min_tokens=3)
    assert sampler.sample(logits.clone(), [FakeRow(params, output_ids=[4, 4])]).tokens == [3]
    assert sampler.sample(logits.clone(), [FakeRow(params, output_ids=[4, 4, 4])]).tokens == [EOS]


def test_ignore_eos_masks_eos(sampler):
    logits = base_logits()
    logits[0, EOS] = 10.0
    assert sampler.sample(logits, [FakeRow(greedy(ignore_eos=True))]).tokens == [3]


def test_top_k_keeps_only_k_best(sampler):
    rows = [FakeRow(SamplingParams(temperature=1.0, top_k=2), seed=s) for s in range(300)]
    tokens = sampler.sample(base_logits(300), rows).tokens
    assert set(tokens) == {3, 7}


def test_top_p_keeps_smallest_nucleus(sampler):
    probs = torch.tensor([0.5, 0.3, 0.15, 0.05, 0, 0, 0, 0, 0, 0]).clamp(min=1e-12)
    logits = probs.log().repeat(400, 1)
    rows = [FakeRow(SamplingParams(temperature=1.0, top_p=0.7), seed=s) for s in range(400)]
    tokens = sampler.sample(logits, rows).tokens
    assert set(tokens) == {0, 1}  # 0.5 < 0.7, 0.5 + 0.3 reaches it: tokens 2.. are cut
    share = tokens.count(0) / len(tokens)
    assert 0.5 < share < 0.75  # renormalised 0.5 / 0.8 = 0.625


def test_top_p_always_keeps_the_top_token(sampler):
    rows = [FakeRow(SamplingParams(temperature=1.0, top_p=0.01), seed=s) for s in range(50)]
    assert set(sampler.sample(base_logits(50), rows).tokens) == {3}


def test_logprobs_are_raw_log_softmax(sampler):
    """Reported logprobs come from the model distribution before bias, penalties and temperature."""
    logits = base_logits()
    raw = torch.log_softmax(logits[0], -1)
    params = greedy(logit_bias={9: 100.0}, logprobs=True, top_logprobs=3, frequency_penalty=1.0)
    out = sampler.sample(logits.clone(), [FakeRow(params, output_ids=[3])])
    assert out.tokens == [9]
    assert out.logprobs[0] == pytest.approx(raw[9].item(), abs=1e-6)
    assert math.fsum(math.exp(v) for v in raw.tolist()) == pytest.approx(1.0, abs=1e-6)


def test_top_logprobs_exactly_k_sorted(sampler):
    logits = base_logits()
    raw = torch.log_softmax(logits[0], -1)
    for k in (1, 3, 5):
        out = sampler.sample(logits.clone(), [FakeRow(greedy(logprobs=True, top_logprobs=k))])
        top = out.top[0]
        assert len(top) == k
        assert [t for t, _ in top] == raw.topk(k).indices.tolist()
        values = [v for _, v in top]
        assert values == sorted(values, reverse=True)
        assert values == pytest.approx(raw.topk(k).values.tolist(), abs=1e-6)


def test_top_logprobs_per_row_k_in_a_batch(sampler):
    rows = [
        FakeRow(greedy(logprobs=True, top_logprobs=2)),
        FakeRow(greedy()),
        FakeRow(greedy(logprobs=True, top_logprobs=5)),
        FakeRow(greedy(logprobs=True)),  # chosen-token logprob only
    ]
    out = sampler.sample(base_logits(4), rows)
    assert [None if t is None else len(t) for t in out.top] == [2, None, 5, None]
    assert len(out.logprobs) == 4


def test_neg_inf_logprobs_are_clamped_to_a_finite_floor(sampler):
    logits = torch.full((1, V), float("-inf"))
    logits[0, 2] = 1.0
    logits[0, 4] = 0.0
    out = sampler.sample(logits, [FakeRow(greedy(logprobs=True, top_logprobs=5))])
    assert out.tokens == [2]
    values = [v for _, v in out.top[0]]
    assert len(values) == 5
    assert all(math.isfinite(v) for v in values)
    assert values[2:] == [LOGPROB_FLOOR] * 3


def test_temperature_sharpens_and_flattens(sampler):
    cold = [FakeRow(SamplingParams(temperature=0.05), seed=s) for s in range(100)]
    assert set(sampler.sample(base_logits(100), cold).tokens) == {3}
    hot = [FakeRow(SamplingParams(temperature=5.0), seed=s) for s in range(300)]
    assert len(set(sampler.sample(base_logits(300), hot).tokens)) >= 8


def test_seeded_row_draws_the_same_alone_and_in_a_batch(sampler):
    logits = torch.randn(3, V, generator=torch.Generator().manual_seed(5))
    params = SamplingParams(temperature=1.0, seed=42)

    alone_row = FakeRow(params, seed=42)
    alone = [sampler.sample(logits[2:3].clone(), [alone_row]).tokens[0] for _ in range(20)]
    batch = [FakeRow(SamplingParams(temperature=1.0), seed=7), FakeRow(greedy()), FakeRow(params, seed=42)]
    in_batch = [sampler.sample(logits.clone(), batch).tokens[2] for _ in range(20)]
    assert in_batch == alone
    assert len(set(alone)) > 1  # really sampled, not collapsed onto one token


def test_mixed_batch_keeps_each_rows_settings(sampler):
    logits = base_logits(4)
    logits[:, EOS] = 10.0
    rows = [
        FakeRow(greedy()),
        FakeRow(greedy(logit_bias={8: 100.0})),
        FakeRow(greedy(min_tokens=5), output_ids=[1]),
        FakeRow(SamplingParams(temperature=1.0, top_k=1)),
    ]
    out = sampler.sample(logits, rows)
    assert out.tokens == [EOS, 8, 3, EOS]


def test_eos_ban_never_empties_a_row(sampler):
    """A grammar that allows only the end: min_tokens / ignore_eos must not leave the row all -inf."""
    for params in (greedy(min_tokens=5, ignore_eos=False), greedy(ignore_eos=True),
                   SamplingParams(temperature=1.0, ignore_eos=True)):
        logits = torch.full((1, V), float("-inf"))
        logits[0, EOS] = 1.0
        assert sampler.sample(logits, [FakeRow(params)]).tokens == [EOS]


def test_min_tokens_bans_the_requests_stop_token_ids(sampler):
    logits = base_logits()  # token 3 is the argmax
    params = greedy(min_tokens=2, stop_token_ids=[3])
    assert sampler.sample(logits.clone(), [FakeRow(params, output_ids=[4])]).tokens == [7]
    assert sampler.sample(logits.clone(), [FakeRow(params, output_ids=[4, 4])]).tokens == [3]


def test_a_failing_grammar_mask_fails_only_its_row(sampler):
    def broken(row):
        raise RuntimeError("matcher failed")

    rows = [FakeRow(greedy()), FakeRow(greedy())]
    out = sampler.sample(base_logits(2), rows, {1: broken})
    assert out.tokens[0] == 3
    assert set(out.row_errors) == {1}


@pytest.mark.parametrize("extra", [{}, {"top_k": 5}, {"top_p": 0.9}])
def test_a_draw_at_the_top_of_the_unit_interval_never_picks_a_masked_token(sampler, monkeypatch, extra):
    """A uniform just below 1 (about 3e-8 of the draws round to 1.0 in float32) still lands on a token of
    positive probability: the last vocabulary entry, masked here as a grammar would, is never chosen."""
    real_rand = torch.rand

    def top_of_interval(*args, **kw):
        if kw.get("generator") is not None and kw.get("dtype") == torch.float64:
            return torch.full(args, 1.0 - 2.0 ** -30, dtype=torch.float64)
        return real_rand(*args, **kw)

    monkeypatch.setattr(torch, "rand", top_of_interval)

    def ban_last(row: torch.Tensor) -> None:
        row[V - 1] = float("-inf")

    rows = [FakeRow(SamplingParams(temperature=1.0, **extra)) for _ in range(3)]
    out = sampler.sample(base_logits(3), rows, {i: ban_last for i in range(3)})
    assert not out.row_errors
    assert V - 1 not in out.tokens
    allowed = [3, 7, 2, 5, 0] if extra else list(range(V - 1))
    assert all(t in allowed for t in out.tokens)


def test_logprobs_are_read_where_a_row_asks_and_equal_alone_and_in_a_mixed_batch(sampler):
    """Only rows that read their tokens' logprobs (logprobs, or best_of > n ranking by the summed logprob) are
    normalised; their values are the raw distribution's, alone or beside rows that read none (which get 0.0)."""
    logits = torch.randn(4, V, generator=torch.Generator().manual_seed(5)) * 2
    want = torch.log_softmax(logits, dim=-1)
    asks = greedy(logprobs=True)
    ranks = SamplingParams(temperature=0.0, n=1, best_of=2)
    mixed = sampler.sample(logits.clone(), [FakeRow(greedy()), FakeRow(asks), FakeRow(greedy()), FakeRow(ranks)])
    for i in (1, 3):
        assert mixed.logprobs[i] == pytest.approx(want[i, mixed.tokens[i]].item(), abs=1e-5)
        alone = sampler.sample(logits[i : i + 1].clone(), [FakeRow(asks if i == 1 else ranks)])
        assert alone.logprobs[0] == mixed.logprobs[i]
    assert mixed.logprobs[0] == mixed.logprobs[2] == 0.0
