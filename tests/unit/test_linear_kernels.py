"""engine.model.linear_kernels: the oneDNN-prepacked and tiled linears agree with F.linear, the choice honours the
override, and a forward laid out any way gives the same logits and greedy tokens as the HF model (a tiny random
Llama)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from engine.model import linear_kernels, tiled_linear
from engine.model.linear_kernels import choose_kind, linear, pack
from engine.model.tiled_linear import TiledWeight
from tests.unit.tiny_models import tiny_llama

pytestmark = pytest.mark.skipif(not torch.backends.mkldnn.is_available(), reason="torch built without oneDNN")


@pytest.mark.parametrize("rows", [1, 8, 37])
def test_packed_linear_matches_f_linear(rows):
    torch.manual_seed(0)
    w, b, x = torch.randn(96, 64), torch.randn(96), torch.randn(rows, 64)
    packed = pack(w, "dnnl")
    assert packed.is_mkldnn
    torch.testing.assert_close(linear(x, packed, b), F.linear(x, w, b), rtol=1e-5, atol=1e-5)
    # a 3-D input keeps its leading shape
    torch.testing.assert_close(linear(x.view(1, rows, 64), packed), F.linear(x, w).view(1, rows, 96),
                               rtol=1e-5, atol=1e-5)


def test_pack_round_trip_is_exact():
    w = torch.randn(40, 48)  # 40 rows: the tiled layout pads to 64
    assert torch.equal(pack(pack(w, "dnnl"), "mkl"), w)
    assert torch.equal(pack(pack(w, "tiled"), "mkl"), w)
    assert torch.equal(pack(pack(pack(w, "tiled"), "dnnl"), "mkl"), w)
    assert pack(w, "mkl") is w


needs_tiled = pytest.mark.skipif(not tiled_linear.available(), reason="the tiled kernel cannot be built here")


def _greedy_tokens(fwd, first_logits: torch.Tensor, prompt: list[int], new: int = 6) -> list[int]:
    """`new` greedy tokens from our forward, the first from the prompt's logits, the rest by decode steps."""
    tokens, pos = [int(first_logits.argmax())], len(prompt)
    for _ in range(new - 1):
        tokens.append(int(fwd.decode([tokens[-1]], [pos])[0].argmax()))
        pos += 1
    return tokens


def _hf_greedy_tokens(model, prompt: list[int], new: int = 6) -> list[int]:
    out = model.generate(torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                         max_new_tokens=new, do_sample=False)
    return out[0, len(prompt):].tolist()


@needs_tiled
@pytest.mark.parametrize(("out_features", "rows"), [(96, 1), (100, 8), (64, 13), (200, 37)])
def test_tiled_linear_matches_f_linear(out_features, rows):
    torch.manual_seed(0)
    w, b, x = torch.randn(out_features, 64), torch.randn(out_features), torch.randn(rows, 64)
    tiled = pack(w, "tiled")
    assert isinstance(tiled, TiledWeight) and tiled.shape == w.shape
    torch.testing.assert_close(linear(x, tiled, b), F.linear(x, w, b), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(linear(x.view(1, rows, 64), tiled), F.linear(x, w).view(1, rows, out_features),
                               rtol=1e-5, atol=1e-5)


@needs_tiled
def test_tiled_rows_do_not_depend_on_their_batch_or_the_isa_variant():
    """Each output is the same sequential FMA sum whatever the row count: a row alone, in any batch, at any
    place of the register blocks (8 rows on AVX-512, 2 on AVX2) gives the same bits, and so do both variants."""
    torch.manual_seed(0)
    w, x = torch.randn(160, 96), torch.randn(29, 96)
    tiled = pack(w, "tiled")
    batch = linear(x, tiled)
    for i in range(29):
        assert torch.equal(linear(x[i : i + 1], tiled)[0], batch[i])
    assert torch.equal(linear(x[5:16], tiled), batch[5:16])
    assert torch.equal(tiled_linear.tiled_linear(x, tiled, avx2=True), batch)


needs_tiled_bf16 = pytest.mark.skipif(not tiled_linear.runs(torch.bfloat16),
                                      reason="the bf16 tiled kernel runs where the CPU has AVX512_BF16")


def test_bf16_pack_round_trip_is_exact():
    for shape in [(40, 48), (100, 63)]:  # N padded to 96 columns; an odd K padded to even
        w = torch.randn(shape).bfloat16()
        tiled = pack(w, "tiled")
        assert tiled.tiles.dtype == torch.bfloat16 and tiled.shape == w.shape
        assert torch.equal(pack(tiled, "mkl"), w)


@needs_tiled_bf16
@pytest.mark.parametrize(("out_features", "in_features", "rows"), [(96, 64, 1), (100, 64, 8), (200, 63, 37)])
def test_tiled_bf16_matches_the_fp32_product_rounded(out_features, in_features, rows):
    """bf16 in, fp32 accumulation, one rounding to bf16 at the end: within a bf16 ulp or two of the exact
    fp32 product of the same bf16 inputs."""
    torch.manual_seed(0)
    w, x = torch.randn(out_features, in_features).bfloat16(), torch.randn(rows, in_features).bfloat16()
    got = linear(x, pack(w, "tiled"))
    assert got.dtype == torch.bfloat16 and got.shape == (rows, out_features)
    exact = F.linear(x.float(), w.float())
    torch.testing.assert_close(got.float(), exact, rtol=2 ** -7, atol=1e-2)


@needs_tiled_bf16
def test_tiled_bf16_rows_do_not_depend_on_their_batch():
    torch.manual_seed(0)
    w, x = torch.randn(160, 96).bfloat16(), torch.randn(29, 96).bfloat16()
    tiled = pack(w, "tiled")
    batch = linear(x, tiled)
    for i in range(29):
        assert torch.equal(linear(x[i : i + 1], tiled)[0], batch[i])
    assert torch.equal(linear(x[5:16], tiled), batch[5:16])


def test_override_and_device(monkeypatch):
    w = [torch.randn(32, 16)]
    monkeypatch.setenv("SIE_LINEAR_KERNEL", "mkl")
    assert choose_kind(torch.device("cpu"), w) == "mkl"
    monkeypatch.setenv("SIE_LINEAR_KERNEL", "dnnl")
    assert choose_kind(torch.device("cpu"), w) == "dnnl"
    monkeypatch.setenv("SIE_LINEAR_KERNEL", "tiled")
    assert choose_kind(torch.device("cpu"), w) == ("tiled" if tiled_linear.available() else "mkl")
    # bf16 weights run tiled only where the CPU has AVX512_BF16 (AMX or not)
    assert choose_kind(torch.device("cpu"), [w[0].bfloat16()]) == ("tiled" if tiled_linear.runs(torch.bfloat16)
                                                                    else "mkl")
    assert choose_kind(torch.device("meta"), w) == "torch"  # never packs off the CPU


@pytest.mark.parametrize(("isa", "times", "expected"), [
    ("AVX512", {"mkl": 1.0, "dnnl": 0.95}, "dnnl"),  # a near tie keeps the ISA's default
    ("AVX2", {"mkl": 1.0, "dnnl": 0.95}, "mkl"),
    ("AVX512", {"mkl": 0.5, "dnnl": 1.0}, "mkl"),  # a clear loss overturns it
    ("AVX2", {"mkl": 1.0, "dnnl": 0.5}, "dnnl"),
    ("AVX512", {"mkl": 0.95, "dnnl": 0.9, "tiled": 1.0}, "tiled"),  # where it runs, tiled is AVX-512's default
    ("AVX512", {"mkl": 1.0, "dnnl": 0.5, "tiled": 1.0}, "dnnl"),
    ("AVX2", {"mkl": 1.0, "dnnl": 0.8, "tiled": 0.6}, "tiled"),  # the fastest of the clear winners
])
def test_timed_choice_isa_default_overturned_by_a_clear_loss(monkeypatch, isa, times, expected):
    monkeypatch.setenv("SIE_LINEAR_KERNEL", "timed")
    monkeypatch.setattr(linear_kernels, "cpu_isa", lambda: isa)
    monkeypatch.setattr(linear_kernels, "_kinds_here", lambda dtype: list(times))
    monkeypatch.setattr(linear_kernels, "measure", lambda weights, kinds: {k: times[k] for k in kinds})
    assert choose_kind(torch.device("cpu"), [torch.randn(32, 16)]) == expected


@pytest.mark.parametrize(("isa", "kinds", "expected"), [
    ("AVX512", ["mkl", "dnnl", "tiled"], "tiled"),
    ("AVX512", ["mkl", "dnnl"], "dnnl"),
    ("AVX512", ["mkl"], "mkl"),
    ("AVX2", ["mkl", "dnnl", "tiled"], "mkl"),
])
def test_the_default_choice_follows_the_isa_and_never_a_timing(monkeypatch, isa, kinds, expected):
    """Loaded twice on one box, a model takes the same path: its activation dtype, KV memory and batch invariance
    must not depend on what else ran while it loaded."""
    monkeypatch.delenv("SIE_LINEAR_KERNEL", raising=False)
    monkeypatch.setattr(linear_kernels, "cpu_isa", lambda: isa)
    monkeypatch.setattr(linear_kernels, "_kinds_here", lambda dtype: list(kinds))

    def no_timing(*args, **kwargs):
        raise AssertionError("the default choice timed the kernels")

    monkeypatch.setattr(linear_kernels, "measure", no_timing)
    assert choose_kind(torch.device("cpu"), [torch.randn(32, 16)]) == expected


def test_measure_times_every_path_this_box_runs():
    times = linear_kernels.measure([torch.randn(64, 32)], rows=(1,), rounds=1)
    expected = {"mkl", "dnnl"} | ({"tiled"} if tiled_linear.available() else set())
    assert set(times) == expected and all(0 < t < 10 for t in times.values())


@torch.inference_mode()
@pytest.mark.parametrize("kind", ["mkl", "dnnl", pytest.param("tiled", marks=needs_tiled)])
def test_forward_with_each_kind_matches_hf(monkeypatch, kind):
    from engine.model.decoder import Decoder
    from engine.runner.model_runner import ModelRunner

    monkeypatch.setenv("SIE_LINEAR_KERNEL", kind)
    model = tiny_llama()
    decoder = Decoder(model, max_len=64)
    assert decoder.linear_kind == kind
    layouts = {"mkl": torch.Tensor, "dnnl": torch.Tensor, "tiled": TiledWeight}
    assert all(isinstance(w.gate_up, layouts[kind]) for w in decoder.layers)
    assert all((kind == "dnnl") == (isinstance(w.gate_up, torch.Tensor) and w.gate_up.is_mkldnn)
               for w in decoder.layers)
    fwd = ModelRunner(decoder, slots=2, max_len=64)
    prompt = [5, 17, 33, 2, 99, 140, 7]
    ref = model(torch.tensor([prompt])).logits[0, -1]
    got = fwd.prefill(0, prompt, 0)
    torch.testing.assert_close(got, ref, rtol=1e-4, atol=1e-4)
    assert _greedy_tokens(fwd, got, prompt) == _hf_greedy_tokens(model, prompt)


@needs_tiled_bf16
@torch.inference_mode()
def test_bf16_weights_on_the_tiled_kernel_keep_fp32_activations(monkeypatch):
    """bf16 weights on our kernel: the GEMMs multiply bf16, everything between them stays fp32 on our kernels
    (the KV cache too), and the logits come out closer to the fp32 model's than HF's own bf16 forward gets."""
    from engine.model.decoder import Decoder
    from engine.runner.model_runner import ModelRunner

    monkeypatch.setenv("SIE_LINEAR_KERNEL", "tiled")
    shape = dict(hidden_size=256, intermediate_size=512, num_attention_heads=4, num_key_value_heads=2)  # head dim 64
    reference, bf16_model = tiny_llama(**shape), tiny_llama(**shape).to(torch.bfloat16)
    decoder = Decoder(bf16_model, max_len=64)
    assert (decoder.linear_kind, decoder.weight_dtype, decoder.dtype) == ("tiled", torch.bfloat16, torch.float32)
    assert decoder.native_attention and decoder.ops.native
    assert all(w.gate_up.tiles.dtype == torch.bfloat16 for w in decoder.layers)
    fwd = ModelRunner(decoder, slots=2, max_len=64)
    assert fwd.cache.k.dtype == torch.float32
    prompt = [5, 17, 33, 2, 99, 140, 7]
    got = fwd.prefill(0, prompt, 0)
    ref = reference(torch.tensor([prompt])).logits[0, -1]
    hf_bf16 = bf16_model(torch.tensor([prompt])).logits[0, -1].float()
    assert got.dtype == torch.float32
    assert (got - ref).abs().max() < (hf_bf16 - ref).abs().max()
    torch.testing.assert_close(got, ref, rtol=0, atol=2e-2)
    assert _greedy_tokens(fwd, got, prompt) == _hf_greedy_tokens(reference, prompt)  # the fp32 model's tokens



@needs_tiled_bf16
def test_amx_covers_every_block_and_group_of_a_wide_linear():
    """The AMX kernel walks 32-row blocks of x against groups of weight column pairs, with x re-laid in tile
    blocks (the vdpbf16ps one, where there is no AMX, its register blocks): every output of a linear wider than one
    group per thread, over rows that end mid-block, read from a strided fp32 view, is the fp32 product of the
    rounded inputs, and a row's bits never depend on its batch."""
    torch.manual_seed(0)
    w = torch.randn(600, 160).bfloat16()
    x = torch.randn(77, 320)[:, 32:192]  # rows 320 floats apart
    tiled = pack(w, "tiled")
    got = tiled_linear.tiled_linear(x, tiled)
    exact = F.linear(x.bfloat16().double(), w.double()).float()
    torch.testing.assert_close(got, exact, rtol=1e-5, atol=1e-4)
    for rows in (slice(0, 1), slice(13, 50), slice(64, 77)):
        assert torch.equal(tiled_linear.tiled_linear(x[rows], tiled), got[rows])

@needs_tiled_bf16
def test_amx_and_vdpbf16ps_variants_agree(monkeypatch):
    """Where the CPU has AMX, the kernel runs on it (K a multiple of 32); its bits may differ from the vdpbf16ps
    variant's (each is its own chain), but both are the fp32 product of the same bf16 inputs, and AMX rows do not
    depend on their batch either."""
    torch.manual_seed(0)
    w, x = torch.randn(192, 128).bfloat16(), torch.randn(37, 128).bfloat16()
    tiled = pack(w, "tiled")
    amx, plain = tiled_linear.tiled_linear(x, tiled), tiled_linear.tiled_linear(x, tiled, amx=False)
    torch.testing.assert_close(amx.float(), plain.float(), rtol=2 ** -7, atol=1e-2)
    for rows in (slice(0, 1), slice(3, 19), slice(16, 37)):
        assert torch.equal(tiled_linear.tiled_linear(x[rows], tiled), amx[rows])
    # fp32 x is rounded to bf16 as it is read, and gets the accumulators back unrounded
    wide = tiled_linear.tiled_linear(x.float(), tiled)
    assert wide.dtype == torch.float32 and torch.equal(wide.bfloat16(), amx)
