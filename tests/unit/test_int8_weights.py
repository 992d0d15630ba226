"""int8 weights (`quantization: int8`): the tiled int8 kernel computes the de-quantized product, a row's bits do not
depend on its batch, the quantization error is bounded by half a step of each column's scale, and a model the
int8 kernels cannot serve is refused by name."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from engine.model import tiled_linear
from engine.model.linear_kernels import linear
from engine.model.tiled_linear import TiledWeight
from tests.unit.tiny_models import tiny_llama

needs_int8 = pytest.mark.skipif(not tiled_linear.runs(torch.int8), reason="int8 weights run on our AVX-512 kernels")


def test_int8_quantization_is_within_half_a_step_of_each_column():
    torch.manual_seed(0)
    w = torch.randn(100, 63) * torch.linspace(0.01, 3, 100)[:, None]  # columns of very different ranges
    q = TiledWeight.int8(w)
    assert q.dtype == torch.int8 and q.shape == w.shape and q.scales.shape == (192,)  # N padded to 96s
    step = w.abs().amax(dim=1, keepdim=True) / 127
    assert ((q.dense() - w).abs() <= step / 2 + 1e-7).all()
    assert torch.equal(TiledWeight.int8(torch.zeros(96, 8)).dense(), torch.zeros(96, 8))  # no 0/0


@needs_int8
@pytest.mark.parametrize(("out_features", "in_features", "rows"), [(96, 64, 1), (100, 64, 8), (200, 63, 37)])
def test_tiled_int8_computes_the_dequantized_product(out_features, in_features, rows):
    torch.manual_seed(0)
    w, b, x = torch.randn(out_features, in_features), torch.randn(out_features), torch.randn(rows, in_features)
    q = TiledWeight.int8(w)
    got = linear(x, q, b)
    assert got.dtype == torch.float32 and got.shape == (rows, out_features)
    torch.testing.assert_close(got, F.linear(x, q.dense(), b), rtol=1e-5, atol=1e-5)


@needs_int8
def test_tiled_int8_rows_do_not_depend_on_their_batch():
    torch.manual_seed(0)
    w, x = torch.randn(160, 96), torch.randn(29, 96)
    q = TiledWeight.int8(w)
    batch = linear(x, q)
    for i in range(29):
        assert torch.equal(linear(x[i : i + 1], q)[0], batch[i])
    assert torch.equal(linear(x[5:16], q), batch[5:16])


@needs_int8
@torch.inference_mode()
def test_an_int8_decoder_keeps_fp32_activations_and_the_fp32_models_choices():
    from engine.model.decoder import Decoder
    from engine.runner.model_runner import ModelRunner

    model = tiny_llama()
    full, quantized = Decoder(model, max_len=64), Decoder(model, max_len=64, quantization="int8")
    assert quantized.dtype == torch.float32 and quantized.linear_kind == "tiled"
    assert all(w.gate_up.dtype == torch.int8 and w.qkv.dtype == torch.int8 for w in quantized.layers)
    assert quantized.lm_head.dtype == torch.int8 and quantized.embed.dtype == torch.float32
    prompt = [5, 17, 33, 2, 99, 140, 7]
    ref = ModelRunner(full, slots=1, max_len=64).prefill(0, prompt, 0)
    got = ModelRunner(quantized, slots=1, max_len=64).prefill(0, prompt, 0)
    assert not torch.equal(got, ref)  # the weights did change
    assert F.cosine_similarity(got, ref, dim=0) > 0.999


def test_int8_on_the_transformers_path_is_refused_by_name():
    from engine.model.selection import build_decoder

    with pytest.raises(ValueError, match="quantization int8 runs on the fused forward only"):
        build_decoder(tiny_llama(), "transformers", 64, "int8")



def test_a_pre_quantized_checkpoint_is_refused_naming_its_method():
    """An AWQ/GPTQ folder would make transformers want that method's kernels package, or load de-quantized."""
    from transformers import LlamaConfig

    from engine.model.support import config_refusal

    assert config_refusal(LlamaConfig()) is None
    refusal = config_refusal(LlamaConfig(quantization_config={"quant_method": "awq", "bits": 4}))
    assert refusal is not None and "quant_method 'awq'" in refusal and "quantization: int8" in refusal
