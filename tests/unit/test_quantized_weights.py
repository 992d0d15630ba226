"""Quantized weights (`quantization: int8 | int4`): each tiled kernel computes the de-quantized product, a row's bits
do not depend on its batch, the quantization error is bounded by half a step (of a column at int8, of a group of 32
at int4), and a model the kernels cannot serve is refused by name."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from engine.model import tiled_linear
from engine.model.linear_kernels import linear
from engine.model.tiled_linear import Int4TiledWeight, TiledWeight
from tests.unit.tiny_models import tiny_llama

# on the CPU's feature alone: where it has AVX-512, kernels that fail to build must fail these tests, not skip them
needs_int8 = pytest.mark.skipif(not torch.backends.cpu.get_cpu_capability().startswith("AVX512"),
                                reason="quantized weights run where the CPU has AVX-512 (our kernels)")


@pytest.fixture
def kernels() -> None:
    """Our CPU ops built (once) and loaded, as the engine's load does before its first forward; on an AVX-512 box a
    build that fails fails the test."""
    assert tiled_linear.runs(torch.int8), "our CPU kernels did not build here"


def test_int8_quantization_is_within_half_a_step_of_each_column():
    torch.manual_seed(0)
    w = torch.randn(100, 63) * torch.linspace(0.01, 3, 100)[:, None]  # columns of very different ranges
    q = TiledWeight.int8(w)
    assert q.dtype == torch.int8 and q.shape == w.shape and q.scales.shape == (192,)  # N padded to 96s
    step = w.abs().amax(dim=1, keepdim=True) / 127
    assert ((q.dense() - w).abs() <= step / 2 + 1e-7).all()
    assert torch.equal(TiledWeight.int8(torch.zeros(96, 8)).dense(), torch.zeros(96, 8))  # no 0/0


def test_int4_quantization_is_within_half_a_step_of_each_group():
    torch.manual_seed(0)
    w = torch.randn(100, 70) * torch.linspace(0.01, 3, 70)  # groups of very different ranges; K padded to 96
    q = Int4TiledWeight(w)
    assert q.tiles.dtype == torch.uint8 and q.tiles.shape == (12, 48, 16) and q.group_scales.shape == (12, 3, 16)
    padded = F.pad(w, (0, 26)).view(100, 3, 32)
    step = ((padded.amax(dim=2) - padded.amin(dim=2)) / 15)[..., None]
    error = (F.pad(q.dense() - w, (0, 26)).view(100, 3, 32)).abs()
    assert (error <= step * 0.51 + 1e-3).all()  # half a step, and the fp16 rounding of scale and minimum
    assert q.shape == w.shape and torch.equal(Int4TiledWeight(torch.zeros(96, 32)).dense(), torch.zeros(96, 32))


LAYOUTS = [pytest.param(TiledWeight.int8, id="int8"), pytest.param(Int4TiledWeight, id="int4")]


@needs_int8
@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize(("out_features", "in_features", "rows"), [(96, 64, 1), (100, 64, 8), (200, 63, 37)])
def test_tiled_quantized_kernels_compute_the_dequantized_product(kernels, layout, out_features, in_features,
                                                                  rows):
    torch.manual_seed(0)
    w, b, x = torch.randn(out_features, in_features), torch.randn(out_features), torch.randn(rows, in_features)
    q = layout(w)
    got = linear(x, q, b)
    assert got.dtype == torch.float32 and got.shape == (rows, out_features)
    torch.testing.assert_close(got, F.linear(x, q.dense(), b), rtol=1e-4, atol=1e-4)


@needs_int8
@pytest.mark.parametrize("layout", LAYOUTS)
def test_tiled_quantized_rows_do_not_depend_on_their_batch(kernels, layout):
    torch.manual_seed(0)
    w, x = torch.randn(160, 96), torch.randn(29, 96)
    q = layout(w)
    batch = linear(x, q)
    for i in range(29):
        assert torch.equal(linear(x[i : i + 1], q)[0], batch[i])
    assert torch.equal(linear(x[5:16], q), batch[5:16])


@needs_int8
@torch.inference_mode()
@pytest.mark.parametrize(("quantization", "layer_dtype", "closeness"), [("int8", torch.int8, 0.999),
                                                                        ("int4", torch.uint8, 0.98)])
def test_a_quantized_decoder_keeps_fp32_activations_and_an_int8_lm_head(quantization, layer_dtype, closeness):
    from engine.model.decoder import Decoder
    from engine.runner.model_runner import ModelRunner

    model = tiny_llama()
    full, quantized = Decoder(model, max_len=64), Decoder(model, max_len=64, quantization=quantization)
    assert quantized.dtype == torch.float32 and quantized.linear_kind == "tiled"
    assert all(w.gate_up.dtype == layer_dtype and w.qkv.dtype == layer_dtype for w in quantized.layers)
    assert quantized.lm_head.dtype == torch.int8 and quantized.embed.dtype == torch.float32
    prompt = [5, 17, 33, 2, 99, 140, 7]
    ref = ModelRunner(full, slots=1, max_len=64).prefill(0, prompt, 0)
    got = ModelRunner(quantized, slots=1, max_len=64).prefill(0, prompt, 0)
    assert not torch.equal(got, ref)  # the weights did change
    assert F.cosine_similarity(got, ref, dim=0) > closeness


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


@needs_int8
@torch.inference_mode()
def test_releasing_the_models_linears_leaves_the_int8_forward_as_it_was():
    from engine.model.decoder import Decoder
    from engine.model.loading import release_linear_weights
    from engine.runner.model_runner import ModelRunner

    model = tiny_llama(tie_word_embeddings=False)
    runner = ModelRunner(Decoder(model, max_len=64, quantization="int8"), slots=1, max_len=64)
    prompt = [5, 17, 33, 2, 99, 140, 7]
    before = runner.prefill(0, prompt, 0)
    shapes = {name: p.shape for name, p in model.named_parameters()}
    release_linear_weights(model)
    linears = [m for m in model.modules() if isinstance(m, torch.nn.Linear)]
    assert linears and all(m.weight.stride() == (0, 0) for m in linears)  # no memory behind them
    assert {name: p.shape for name, p in model.named_parameters()} == shapes
    assert model.model.embed_tokens.weight.stride() != (0, 0)  # the prompt's embeddings stay
    assert torch.equal(runner.prefill(0, prompt, 0), before)


@needs_int8
@pytest.mark.parametrize("quantization", ["int8", "int4"])
def test_a_lora_adapter_applies_on_quantized_weights(quantization):
    """The adapter's delta is added in full precision beside the quantized product, and loads after the model's own
    linears were let go: the demo adapter still talks like a pirate."""
    from engine.llm_engine import EngineConfig, LLMEngine
    from engine.sampling_params import SamplingParams

    from .conftest import MODEL_DIR, _require_model
    from .engine_run import generate_all, joined_text

    _require_model()
    adapter = MODEL_DIR.parent / "smollm2-lora-pirate"
    if not (adapter / ".complete").exists():
        pytest.skip(f"demo adapter not built at {adapter} (run `make model`)")
    engine = LLMEngine(EngineConfig(str(MODEL_DIR), max_slots=2, max_len=256, threads=2, quantization=quantization,
                                    lora_paths={"pirate": str(adapter)}))
    engine.start()
    try:
        prompt = engine.tokenizer.apply_chat_template([{"role": "user", "content": "Tell me about the sea."}],
                                                      add_generation_prompt=True, tokenize=False)
        base, pirate = (joined_text(outs) for outs in generate_all(
            engine, [prompt, prompt], [SamplingParams(max_tokens=16, temperature=0.0),
                                       SamplingParams(max_tokens=16, temperature=0.0, lora_adapter="pirate")]))
    finally:
        engine.stop()
    assert "arr" not in base.lower() and "arr" in pirate.lower()
