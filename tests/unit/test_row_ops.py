"""engine.sampling.row_ops on our kernels (engine/model/kernels/row_ops.cpp): logsumexp, argmax and topk agree with
torch's (topk and argmax exactly, ties to the lower id), reduce each row alone (a row's results do not depend on its
batch or the ISA variant), and refuse what they cannot run."""

from __future__ import annotations

import pytest
import torch

from engine.model import cpu_kernels
from engine.sampling import row_ops

pytestmark = pytest.mark.skipif(not cpu_kernels.available(), reason="our CPU kernels cannot be built here")
ops = torch.ops.sie_kernels if cpu_kernels.available() else None


def logits(rows: int, vocab: int, seed: int = 0) -> torch.Tensor:
    return torch.randn(rows, vocab, generator=torch.Generator().manual_seed(seed)) * 4


def reference_topk(x: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Value descending, then id ascending: a stable sort of the negated values."""
    order = torch.sort(-x, dim=-1, stable=True).indices[:, :k]
    return x.gather(1, order), order


@pytest.mark.parametrize("vocab", [1, 63, 64, 1000, 49152])
def test_logsumexp_and_argmax_match_torch(vocab):
    x = logits(5, vocab)
    torch.testing.assert_close(row_ops.logsumexp(x), torch.logsumexp(x, dim=-1), rtol=1e-6, atol=1e-5)
    assert torch.equal(row_ops.argmax(x), x.argmax(dim=-1))


def test_argmax_takes_the_first_of_tied_maxima_and_a_row_of_minus_infinity():
    x = logits(3, 5000)
    x[0, [4321, 77, 2500]] = 100.0
    x[1] = float("-inf")
    x[2, 4999] = 100.0  # in the scalar tail after the last whole block
    assert row_ops.argmax(x).tolist() == [77, 0, 4999]
    assert row_ops.logsumexp(x)[1].item() == float("-inf")


@pytest.mark.parametrize(("vocab", "k"), [(49152, 1), (49152, 5), (49152, 50), (49152, 256), (1000, 20), (300, 300),
                                          (70, 3), (5, 5)])
def test_topk_matches_a_stable_sort(vocab, k):
    x = logits(4, vocab, seed=k)
    values, ids = row_ops.topk(x, k)
    ref_values, ref_ids = reference_topk(x, k)
    assert torch.equal(ids, ref_ids)
    assert torch.equal(values, ref_values)


def test_topk_ties_go_to_the_lower_id_and_minus_infinity_is_still_ranked():
    x = torch.full((2, 4096), float("-inf"))
    x[0, ::7] = 1.0  # 586 ties: the 50 kept are the 50 lowest ids
    x[1, [3000, 10, 2000]] = 2.0  # 3 finite entries, k = 8: five -inf entries by id
    values, ids = row_ops.topk(x, 50)
    assert ids[0].tolist() == list(range(0, 350, 7))
    values, ids = row_ops.topk(x[1:], 8)
    assert ids[0].tolist() == [10, 2000, 3000, 0, 1, 2, 3, 4]
    assert values[0, :3].tolist() == [2.0, 2.0, 2.0] and values[0, 3:].eq(float("-inf")).all()


@pytest.mark.parametrize("avx2", [False, True])
def test_a_rows_results_do_not_depend_on_its_batch_or_the_isa(avx2):
    x = logits(9, 49152)
    alone = x[6:7].clone()
    for op in (lambda t, a: ops.row_logsumexp(t, a), lambda t, a: ops.row_argmax(t, a),
               lambda t, a: ops.row_topk(t, 40, a)[1], lambda t, a: ops.row_topk(t, 40, a)[0]):
        batched = op(x, avx2)[6]
        assert torch.equal(batched, op(alone, avx2)[0])
        assert torch.equal(batched, op(alone, not avx2)[0])


def test_a_row_view_with_a_stride_is_read_in_place():
    x = logits(6, 1024)
    every_other = x[::2]
    assert torch.equal(row_ops.topk(every_other, 7)[1], reference_topk(every_other, 7)[1])
    assert torch.equal(row_ops.argmax(every_other), every_other.argmax(dim=-1))


@pytest.mark.parametrize("case", ["k above the vocabulary", "k of zero", "fp64", "one dimension"])
def test_refuses_what_it_cannot_run(case):
    x = logits(2, 100)
    with pytest.raises(RuntimeError, match="row_"):
        if case == "k above the vocabulary":
            ops.row_topk(x, 101)
        elif case == "k of zero":
            ops.row_topk(x, 0)
        elif case == "fp64":
            ops.row_argmax(x.double())
        else:
            ops.row_logsumexp(x[0])


@pytest.mark.parametrize("with_prompt", [True, False])
def test_penalties_in_place_match_the_torch_path_bit_for_bit(with_prompt):
    from engine.sampling.sampler import penalise_sparse

    g = torch.Generator().manual_seed(1)
    x = logits(5, 3000)
    counts = torch.zeros(7, 3000)
    counts[:, :400] = torch.randint(0, 3, (7, 400), generator=g).float()  # some seen, some not
    rows, count_rows = torch.tensor([4, 0, 2]), torch.tensor([6, 1, 3])
    prompt = (torch.rand(3, 3000, generator=g) < 0.05) if with_prompt else None
    settings = torch.tensor([[1.3, 0.5, 0.2], [1.0, -0.4, 0.0], [0.8, 0.0, 1.5]])  # repetition, presence, frequency
    expected = x.clone()
    expected[rows] = penalise_sparse(x[rows].clone(), counts[count_rows], prompt, settings[:, 0:1], settings[:, 1:2],
                                     settings[:, 2:3])
    row_ops.penalize_(x, rows, counts, count_rows, prompt, settings)
    assert torch.equal(x, expected)
    assert not torch.equal(x[rows], logits(5, 3000)[rows])  # it did change them
