"""engine/model/kernels/lora_add.cpp: out[rows] += (x[rows] @ A^T) @ B^T in one call agrees with the product in fp64,
works row by row (a row's bits do not depend on its batch, its place in it, or the ISA variant), touches only the
rows it is given, and refuses what it cannot run. The adapter end to end: tests/unit/test_engine_lora.py."""

from __future__ import annotations

import pytest
import torch

from engine.model import cpu_kernels
from engine.model.lora import LoraDelta

pytestmark = pytest.mark.skipif(not cpu_kernels.available(), reason="our CPU kernels cannot be built here")
ops = torch.ops.sie_kernels if cpu_kernels.available() else None


def operands(rows: int, k: int, n: int, rank: int, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(rows, n, generator=g), torch.randn(rows, k, generator=g), torch.randn(rank, k, generator=g),
            torch.randn(rank, n, generator=g))


@pytest.mark.parametrize(("rows", "k", "n", "rank"), [(1, 576, 3072, 16), (3, 64, 960, 12), (8, 1536, 576, 8),
                                                      (9, 576, 960, 24), (37, 128, 48, 5)])
def test_all_rows_match_the_fp64_product(rows, k, n, rank):
    """Within fp32 rounding of the largest output (1e-6 of it): the sums reach ~600 here, and torch's own fp32
    matmuls land up to 1.8e-4 from fp64 on the AVX-512 EPYC (ours 1.2e-4), past a fixed 1e-4."""
    out, x, a, b_t = operands(rows, k, n, rank)
    expected = out.double() + (x.double() @ a.double().t()) @ b_t.double()
    ops.lora_add_(out, x, None, a, b_t)
    torch.testing.assert_close(out.double(), expected, rtol=0, atol=1e-6 * expected.abs().max().item())


def test_only_the_listed_rows_change():
    out, x, a, b_t = operands(10, 64, 96, 8)
    rows = torch.tensor([7, 2, 5])
    expected = out.clone()
    expected[rows] += (x[rows] @ a.t()) @ b_t
    untouched = [r for r in range(10) if r not in (2, 5, 7)]
    before = out[untouched].clone()
    ops.lora_add_(out, x, rows, a, b_t)
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-4)
    assert torch.equal(out[untouched], before)


@pytest.mark.parametrize("avx2", [False, True])
def test_a_rows_bits_do_not_depend_on_its_batch(avx2):
    """Row 4 alone, in 6 rows, in 20 (a later row block), picked by index, and in the other ISA: the same bits."""
    out, x, a, b_t = operands(20, 576, 960, 16)
    alone = out[4:5].clone()
    ops.lora_add_(alone, x[4:5], None, a, b_t, avx2)
    for batch in (6, 20):
        o = out[:batch].clone()
        ops.lora_add_(o, x[:batch], None, a, b_t, avx2)
        assert torch.equal(o[4], alone[0])
    shifted = out.roll(9, 0).clone()  # row 4 now at 13, in the second block of 8
    ops.lora_add_(shifted, x.roll(9, 0), torch.tensor([13, 0]), a, b_t, avx2)
    assert torch.equal(shifted[13], alone[0])
    other = out[4:5].clone()
    ops.lora_add_(other, x[4:5], None, a, b_t, not avx2)
    assert torch.equal(other, alone)


def test_the_torch_fallback_adds_the_same_delta():
    out, x, a, b_t = operands(6, 64, 96, 8)
    native, fallback = out.clone(), out.clone()
    rows = torch.tensor([1, 4])
    LoraDelta(a, b_t, native=True).add_to(native, x, rows)
    LoraDelta(a, b_t, native=False).add_to(fallback, x, rows)
    torch.testing.assert_close(native, fallback, rtol=1e-5, atol=1e-4)


@pytest.mark.parametrize("case", ["row out of range", "negative row", "rank mismatch", "width not 16", "bf16"])
def test_refuses_what_it_cannot_run(case):
    out, x, a, b_t = operands(4, 64, 96, 8)
    rows = None
    if case == "row out of range":
        rows = torch.tensor([4])
    elif case == "negative row":
        rows = torch.tensor([-1])
    elif case == "rank mismatch":
        b_t = b_t[:7].contiguous()
    elif case == "width not 16":
        out, b_t = out[:, :90].contiguous(), b_t[:, :90].contiguous()
    else:
        x = x.bfloat16()
    with pytest.raises(RuntimeError, match="lora_add_"):
        ops.lora_add_(out, x, rows, a, b_t)
