"""engine.model.layer_ops: our fused RMSNorm (+ residual add), RoPE and SiLU x up agree with torch's ops (RoPE bit for
bit), work row by row (a row's bits do not depend on its batch or the ISA variant), and refuse shapes they cannot
run."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from engine.model import cpu_kernels
from engine.model.layer_ops import LayerOps, rotate

pytestmark = pytest.mark.skipif(not cpu_kernels.available(), reason="our CPU kernels cannot be built here")
ops = torch.ops.sie_kernels if cpu_kernels.available() else None


@pytest.mark.parametrize("rows", [1, 7, 300])
def test_rms_norm_and_the_residual_add_before_it(rows):
    torch.manual_seed(0)
    h, delta, w = torch.randn(rows, 576), torch.randn(rows, 576), torch.randn(576)
    torch.testing.assert_close(ops.rms_norm(h, None, w, 1e-5), F.rms_norm(h, (576,), w, 1e-5), rtol=1e-5, atol=1e-5)
    expected_h = h + delta
    normed = ops.rms_norm(h, delta, w, 1e-5)
    assert torch.equal(h, expected_h)  # updated in place
    torch.testing.assert_close(normed, F.rms_norm(expected_h, (576,), w, 1e-5), rtol=1e-5, atol=1e-5)


def test_rope_matches_torch_bit_for_bit_in_place_on_a_view():
    torch.manual_seed(0)
    qkv = torch.randn(11, 15, 64)  # 9 query heads, 3 key heads, then 3 value heads the rotation must not touch
    cos, sin_signed = torch.randn(11, 64), torch.randn(11, 64)
    expected = rotate(qkv[:, :12], cos[:, None], sin_signed[:, None])
    values = qkv[:, 12:].clone()
    ops.rope_(qkv[:, :12], cos, sin_signed)
    assert torch.equal(qkv[:, :12], expected)
    assert torch.equal(qkv[:, 12:], values)


def test_silu_mul_matches_torch_over_a_wide_range():
    torch.manual_seed(0)
    gate_up = torch.randn(5, 3072) * 30  # exp's clamps: silu(-90) is -0, silu(90) is 90
    gate, up = gate_up.chunk(2, dim=-1)
    out = ops.silu_mul(gate_up)
    assert torch.isfinite(out).all()
    torch.testing.assert_close(out, F.silu(gate) * up, rtol=1e-5, atol=1e-5)


def test_a_row_gives_the_same_bits_alone_in_a_batch_and_on_both_isas():
    torch.manual_seed(0)
    h, delta, w, gate_up = torch.randn(40, 192), torch.randn(40, 192), torch.randn(192), torch.randn(40, 512)
    norm_batch, act_batch = ops.rms_norm(h, None, w, 1e-6), ops.silu_mul(gate_up)
    assert torch.equal(ops.rms_norm(h, None, w, 1e-6, avx2=True), norm_batch)
    assert torch.equal(ops.silu_mul(gate_up, avx2=True), act_batch)
    for i in (0, 17, 39):
        assert torch.equal(ops.rms_norm(h[i : i + 1], None, w, 1e-6)[0], norm_batch[i])
        assert torch.equal(ops.silu_mul(gate_up[i : i + 1])[0], act_batch[i])
    h2 = h.clone()
    assert torch.equal(ops.rms_norm(h, delta, w, 1e-6), ops.rms_norm(h2, delta, w, 1e-6, avx2=True))
    x, cos, sin = torch.randn(40, 4, 64), torch.randn(40, 64), torch.randn(40, 64)
    x2 = x.clone()
    ops.rope_(x, cos, sin)
    ops.rope_(x2, cos, sin, avx2=True)
    assert torch.equal(x, x2)


def test_native_and_torch_paths_agree():
    torch.manual_seed(0)
    native, fallback = LayerOps(True, 1e-5), LayerOps(False, 1e-5)
    h, delta, w = torch.randn(6, 64), torch.randn(6, 64), torch.randn(64)
    h_native, normed_native = native.add_norm(h.clone(), delta, w)
    h_torch, normed_torch = fallback.add_norm(h, delta, w)
    assert torch.equal(h_native, h_torch)
    torch.testing.assert_close(normed_native, normed_torch, rtol=1e-5, atol=1e-5)
    x, cos, sin = torch.randn(6, 3, 64), torch.randn(6, 1, 64), torch.randn(6, 1, 64)
    assert torch.equal(native.rope(x.clone(), cos, sin), fallback.rope(x, cos, sin))
    gate_up = torch.randn(6, 128)
    torch.testing.assert_close(native.silu_mul(gate_up), fallback.silu_mul(gate_up), rtol=1e-5, atol=1e-6)


def test_where_the_kernels_run():
    cpu = torch.device("cpu")
    assert LayerOps.native_supported(torch.float32, cpu, 576, 1536, 64)
    assert not LayerOps.native_supported(torch.bfloat16, cpu, 576, 1536, 64)
    assert not LayerOps.native_supported(torch.float32, cpu, 72, 1536, 64)  # rows of whole 16-lane vectors
    assert not LayerOps.native_supported(torch.float32, cpu, 576, 1536, 48)  # RoPE halves of 16 lanes
    assert not LayerOps.native_supported(torch.float32, torch.device("meta"), 576, 1536, 64)


def test_bad_shapes_are_refused():
    with pytest.raises(RuntimeError, match="multiple of 16"):
        ops.rms_norm(torch.randn(2, 40), None, torch.randn(40), 1e-6)
    with pytest.raises(RuntimeError, match="weight of the row length"):
        ops.rms_norm(torch.randn(2, 32), None, torch.randn(16), 1e-6)
    with pytest.raises(RuntimeError, match="multiple of 32"):
        ops.rope_(torch.randn(2, 3, 48), torch.randn(2, 48), torch.randn(2, 48))
    with pytest.raises(RuntimeError, match="fp32"):
        ops.silu_mul(torch.randn(2, 64, dtype=torch.bfloat16))
