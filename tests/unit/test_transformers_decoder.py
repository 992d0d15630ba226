"""The transformers model path against transformers itself, on the real Gemma 3 270M (sliding window 512).

Reference: the HF model's own forward over the whole sequence, no cache (sdpa). Ours: the same modeling code
with our attention function on the engine's KV cache, in prefill chunks and decode steps, alone and batched.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")

REPO = Path(__file__).resolve().parents[2]
GEMMA_DIR = Path(os.environ.get("SIE_MODEL_CACHE") or REPO / ".cache" / "models") / "gemma-3-270m"
TOLERANCE = 2e-3  # fp32; logits are O(30). Measured differences are ~5e-5.


@pytest.fixture(scope="module")
def gemma():
    if not (GEMMA_DIR / "config.json").exists():
        pytest.skip(f"Gemma 3 not prepared at {GEMMA_DIR} (run `make model`)")
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(GEMMA_DIR)
    model = AutoModelForCausalLM.from_pretrained(GEMMA_DIR, dtype=torch.float32, attn_implementation="sdpa").eval()
    text = " ".join(f"Item {i}: the {['red', 'blue', 'green'][i % 3]} box holds {i * 7 % 13} stones."
                    for i in range(60))
    ids = tokenizer(text).input_ids[:600]
    assert len(ids) == 600 and model.config.sliding_window == 512
    with torch.inference_mode():
        reference = model(torch.tensor([ids])).logits[0].float()
        short = model(torch.tensor([ids[:40]])).logits[0].float()
    from engine.model.transformers_decoder import TransformersDecoder
    from engine.runner.model_runner import ModelRunner

    runner = ModelRunner(TransformersDecoder(model, max_len=1024), slots=4, max_len=1024)
    return runner, ids, reference, short


def copy_positions(cache, src: int, dst: int, length: int) -> None:
    """Slot `dst` holds a copy of slot `src`'s first `length` positions, in its own blocks (a new cache gives each
    slot blocks of its own)."""
    for j in range(-(-length // cache.block_size)):
        cache.copy_block(int(cache.rows[src, j]), int(cache.rows[dst, j]))


def _close(ours, theirs):
    assert (ours - theirs).abs().max().item() < TOLERANCE


def test_chunked_prefill_then_decode_past_the_window_equals_hf(gemma):
    runner, ids, reference, _ = gemma
    # chunks of 200: the third attends to a cached prefix with the sliding layers' window cutting into it
    for start, end in ((0, 200), (200, 400), (400, 560)):
        _close(runner.prefill(1, ids[start:end], start), reference[end - 1])
    copy_positions(runner.cache, 1, 0, 560)
    for pos in range(560, 600):  # each decode step reads past the 512 window
        _close(runner.decode([ids[pos]], [pos])[0], reference[pos])


def _prefill_every_position(runner, slot: int, ids: list[int], start: int):
    """A prefill as the engine runs it, and its hidden states at every position of the chunk (the runner keeps
    only the last one's logits): the model's own output, recorded on its way out."""
    decoder, seen = runner.decoder, []
    hidden_of = decoder._hidden

    def recording(*args, **kwargs):
        seen.append(hidden_of(*args, **kwargs))
        return seen[-1]

    decoder._hidden = recording
    try:
        last = runner.prefill(slot, ids, start)
    finally:
        del decoder._hidden
    return last, seen[0]


def test_prefill_logits_equal_hf_at_every_position_in_one_prefill_and_in_chunks(gemma):
    runner, ids, reference, _ = gemma
    # one 600-token prefill past the 512 window, then chunks whose later ones attend to a cached prefix
    for chunks in (((0, 600),), ((0, 250), (250, 520), (520, 600))):
        for start, end in chunks:
            last, hidden = _prefill_every_position(runner, 3, ids[start:end], start)
            assert hidden.shape[0] == end - start
            _close(last, reference[end - 1])
            for a in range(0, end - start, 100):  # 100 positions of 262k logits at a time
                b = min(a + 100, end - start)
                _close(runner.decoder.logits(hidden[a:b]), reference[start + a : start + b])


def test_a_model_with_no_chat_template_answers_chat_with_a_400_naming_messages(gemma):
    from transformers import AutoTokenizer

    from contract.error_codes import lookup
    from engine.errors import EngineError
    from engine.text.chat import render_chat

    tokenizer = AutoTokenizer.from_pretrained(GEMMA_DIR)  # the GGUF carries none; the profile adds Gemma's
    assert not tokenizer.chat_template
    with pytest.raises(EngineError) as info:
        render_chat(tokenizer, [{"role": "user", "content": "Hi"}])
    assert (lookup(info.value.code).http, info.value.param) == (400, "messages")
    assert "no chat template" in info.value.message


def test_batched_rows_at_different_positions_equal_hf(gemma):
    runner, ids, reference, short = gemma
    # row 0: the long sequence past the window; row 1: a short prompt, batched prefill beside another one
    runner.prefill(0, ids[:590], 0)
    logits = runner.prefill_batch([1, 2], [ids[:39], ids[:20]], [None, None])
    _close(logits[0], short[38])
    _close(logits[1], short[19])
    step = runner.decode([ids[590], ids[39]], [590, 39])
    _close(step[0], reference[590])
    _close(step[1], short[39])


def test_batched_prompts_continue_each_slots_cached_prefix_and_equal_hf(gemma):
    """Prefix-cache hits are batched: each row starts at its own cached length (one past the 512 window)."""
    runner, ids, reference, short = gemma
    runner.prefill(1, ids[:530], 0)  # slot 1 holds a long prefix, slot 2 a short one, slot 3 nothing
    runner.prefill(2, ids[:16], 0)
    logits = runner.prefill_batch([1, 2, 3], [ids[530:545], ids[16:39], ids[:20]], [None, None, None],
                                  starts=[530, 16, 0])
    _close(logits[0], reference[544])
    _close(logits[1], short[38])
    _close(logits[2], short[19])
    step = runner.decode([ids[590], ids[545], ids[39], ids[20]], [590, 545, 39, 20])
    _close(step[1], reference[545])
    _close(step[2], short[39])
    _close(step[3], short[20])


def test_unsupported_models_are_refused_at_load_naming_the_feature():
    from engine.model.transformers_decoder import transformers_path_gaps

    class Config:
        use_bidirectional_attention = True
        vision_config = None

    class NoInterface(torch.nn.Module):
        config = Config()

    problems = transformers_path_gaps(NoInterface())
    assert any("attention interface" in p for p in problems)
    assert any("bidirectional" in p for p in problems)


def test_fused_and_transformers_paths_agree_on_smollm2():
    """`auto` picks the fused forward for Llama only because it is exact there: both paths give the same logits."""
    smollm2 = GEMMA_DIR.parent / "SmolLM2-135M-Instruct"
    if not (smollm2 / "config.json").exists():
        pytest.skip("SmolLM2 not prepared (run `make model`)")
    from transformers import AutoModelForCausalLM

    from engine.model.selection import build_decoder
    from engine.runner.model_runner import ModelRunner

    ids = list(range(100, 170))
    decoders = [build_decoder(AutoModelForCausalLM.from_pretrained(smollm2, dtype=torch.float32).eval(), impl, 128)
                for impl in ("auto", "transformers")]
    assert [type(d).__name__ for d in decoders] == ["Decoder", "TransformersDecoder"]
    runners = [ModelRunner(d, 2, 128) for d in decoders]
    prefill = [r.prefill(0, ids[:60], 0) for r in runners]
    _close(prefill[0], prefill[1])
    for r in runners:
        copy_positions(r.cache, 0, 1, 60)
    steps = [r.decode(ids[60:62], [60, 58]) for r in runners]  # rows at different positions: masked attention
    _close(steps[0], steps[1])


def test_forcing_the_fused_path_on_gemma_names_what_it_lacks(gemma):
    runner, *_ = gemma
    from engine.model.selection import build_decoder

    with pytest.raises(ValueError, match="Gemma3ForCausalLM"):
        build_decoder(runner.decoder.model, "fused", 64)
