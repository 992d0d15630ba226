"""Image input in the engine, on the tiny random-weight Llava (its words are noise; the path is what is tested)."""

from __future__ import annotations

import io
import queue

import pytest

from tests.tiny_vlm import ensure_tiny_vlm

MAX_LEN = 256


def png(color: tuple[int, int, int], size: tuple[int, int] = (48, 40)) -> bytes:
    from PIL import Image

    buf = io.BytesIO()
    Image.new("RGB", size, color).save(buf, format="PNG")
    return buf.getvalue()


def checkerboard() -> bytes:
    from PIL import Image

    img = Image.new("RGB", (64, 64))
    img.putdata([(255, 255, 255) if (x // 8 + y // 8) % 2 else (0, 0, 0) for y in range(64) for x in range(64)])
    buf = io.BytesIO()
    img.save(buf, format="JPEG")
    return buf.getvalue()


def make_engine(max_num_batched_tokens: int = 512):
    from engine.llm_engine import EngineConfig, LLMEngine

    path = ensure_tiny_vlm()
    if path is None:
        pytest.skip("the SmolLM2 tokenizer is not prepared (run `make model`)")
    return LLMEngine(EngineConfig(str(path), max_slots=4, max_len=MAX_LEN,
                                  max_num_batched_tokens=max_num_batched_tokens, threads=2,
                                  check_scheduler_invariants=True))


@pytest.fixture(scope="module")
def vlm():
    eng = make_engine()
    eng.start()
    yield eng
    eng.stop()


def params(**kw):
    from engine.sampling_params import SamplingParams

    return SamplingParams.from_dict({"max_tokens": 6, "temperature": 0, **kw}, {})


def run(eng, prompt=None, messages=None, images=None, **kw):
    """Submit one request through encode_inputs -> EngineRequest -> the engine loop; the collected outputs."""
    from engine.request import EngineRequest

    p = params(**kw)
    ids, embeds = eng.encode_inputs(prompt, messages, p, images)
    out: queue.Queue = queue.Queue()
    eng.submit(EngineRequest("r", ids, p, out.put, False, prompt_embeds=embeds))
    outputs = []
    while not outputs or not outputs[-1].final:
        outputs.append(out.get(timeout=60))
    return ids, outputs


def first_token_logits(eng, ids, embeds, chunk: int = 1000):
    """Prefill on a private KV cache (the engine's weights), optionally in chunks; logits of the last token."""

    from engine.runner.model_runner import ModelRunner

    fwd = ModelRunner(eng.runner.decoder, 1, MAX_LEN)
    for start in range(0, len(ids), chunk):
        end = min(start + chunk, len(ids))
        logits = fwd.prefill(0, ids[start:end], start, embeds=None if embeds is None else embeds[start:end])
    return logits


def test_native_image_request_runs(vlm):
    ids, outputs = run(vlm, prompt="What is in the picture?", images=[png((255, 0, 0))])
    final = outputs[-1]
    assert final.error is None and final.finish_reason == "length"
    assert final.completion_tokens == 6
    image_id = vlm.vision.image_token_id
    assert ids.count(image_id) == 16  # (64/16)^2 patches; CLIP's CLS is dropped
    assert final.prompt_tokens == len(ids)
    # one user turn, the image placeholders before the prompt text
    text = vlm.tokenizer.decode(ids)
    assert text.startswith("<|im_start|>user\n<image>") and text.endswith("What is in the picture?<|im_end|>\n"
                                                                        "<|im_start|>assistant\n")


def test_chat_images_go_before_the_last_user_text(vlm):
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"},
                {"role": "assistant", "content": "Hello"}, {"role": "user", "content": "And this?"}]
    ids, outputs = run(vlm, messages=messages, images=[png((0, 255, 0)), checkerboard()])
    assert outputs[-1].error is None and outputs[-1].completion_tokens == 6
    text = vlm.tokenizer.decode(ids)
    last_user = text.rindex("<|im_start|>user\n")
    assert text.count("<image>") == 32 and text.index("<image>") > last_user
    assert text[last_user:].startswith("<|im_start|>user\n" + "<image>" * 32 + "And this?")


def test_the_processor_sees_the_pixels(vlm):
    p = params()
    ids_red, emb_red = vlm.encode_inputs("Describe it.", None, p, [png((255, 0, 0))])
    ids_blue, emb_blue = vlm.encode_inputs("Describe it.", None, p, [png((0, 0, 255))])
    assert ids_red == ids_blue
    image = [i == vlm.vision.image_token_id for i in ids_red]
    text_rows = [i for i, is_img in enumerate(image) if not is_img]
    image_rows = [i for i, is_img in enumerate(image) if is_img]
    assert (emb_red[text_rows] == emb_blue[text_rows]).all()
    assert not (emb_red[image_rows] - emb_blue[image_rows]).abs().lt(1e-6).all()
    # the image embeddings reach the first-token logits
    assert (first_token_logits(vlm, ids_red, emb_red) - first_token_logits(vlm, ids_blue, emb_blue)).abs().max() > 1e-4
    # and the same image twice is deterministic
    _, emb_red2 = vlm.encode_inputs("Describe it.", None, p, [png((255, 0, 0))])
    assert (emb_red2 == emb_red).all()


def test_engine_forward_matches_transformers_llava(vlm):
    """Our embeddings + Decoder (prefilled in uneven chunks) equal Llava's own forward."""
    import torch
    from PIL import Image

    p = params()
    ids, embeds = vlm.encode_inputs("Describe it.", None, p, [checkerboard(), png((10, 200, 30))])
    ours = first_token_logits(vlm, ids, embeds, chunk=7)
    pixel_values = vlm.vision.processor.image_processor(
        [Image.open(io.BytesIO(checkerboard())).convert("RGB"), Image.open(io.BytesIO(png((10, 200, 30))))],
        return_tensors="pt")["pixel_values"]
    with torch.inference_mode():
        ref = vlm.model(input_ids=torch.tensor([ids]), pixel_values=pixel_values).logits[0, -1].float()
    torch.testing.assert_close(ours, ref, atol=1e-4, rtol=1e-4)


def test_chunked_prefill_in_the_scheduler_matches_one_chunk(vlm):
    """The scheduler slices the prompt embeddings per prefill chunk: a budget of 5 tokens gives the same tokens."""
    small = make_engine(max_num_batched_tokens=5)
    small.start()
    try:
        kw = {"max_tokens": 8, "logprobs": True}
        _, a = run(vlm, prompt="Look:", images=[checkerboard()], **kw)
        _, b = run(small, prompt="Look:", images=[checkerboard()], **kw)
    finally:
        small.stop()
    tokens = [[e["token"] for o in outs for e in (o.logprobs or [])] for outs in (a, b)]
    assert len(tokens[0]) == 8 and tokens[0] == tokens[1]


def test_text_only_request_on_the_vlm(vlm):
    ids, outputs = run(vlm, prompt="Once upon a time")
    assert outputs[-1].error is None and outputs[-1].completion_tokens == 6
    assert vlm.vision.image_token_id not in ids
    _, outputs = run(vlm, messages=[{"role": "user", "content": "Hello"}])
    assert outputs[-1].error is None and outputs[-1].completion_tokens == 6


@pytest.mark.parametrize("data", [b"not an image", png((1, 2, 3))[:40], b""])
def test_corrupt_image_is_invalid_request(vlm, data):
    from engine.errors import EngineError

    with pytest.raises(EngineError) as exc:
        vlm.encode_inputs("What is this?", None, params(), [png((0, 0, 0)), data])
    # the second image is the bad one: the engine names its place, the gateway maps that to the client's field
    assert exc.value.code == "invalid_request" and exc.value.param == "images[1]"
    assert exc.value.message == "image 1 is not an image this model can decode"


def test_text_model_rejects_images(real_engine):
    from engine.errors import EngineError

    with pytest.raises(EngineError) as exc:
        real_engine.encode_inputs("What is this?", None, params(), [png((0, 0, 0))])
    assert exc.value.code == "unsupported_field" and exc.value.param == "images"


def test_an_image_over_the_pixel_budget_is_refused_from_its_header(vlm):
    """Images just under Pillow's bomb limit took gigabytes to decode; ours are checked before decoding."""
    from engine.errors import EngineError

    with pytest.raises(EngineError) as exc:
        vlm.encode_inputs("What is this?", None, params(), [png((9, 9, 9), (4200, 4100))])
    assert exc.value.code == "invalid_request" and exc.value.param == "images"
    assert "4200x4100" in exc.value.message


def test_images_over_the_request_budget_are_refused_before_any_is_decoded(vlm, monkeypatch):
    from PIL import ImageFile

    from engine.errors import EngineError

    monkeypatch.setattr(vlm.vision, "max_request_pixels", 3 * 48 * 40 - 1, raising=False)
    decoded = []
    real_load = ImageFile.ImageFile.load
    monkeypatch.setattr(ImageFile.ImageFile, "load", lambda self: decoded.append(self) or real_load(self))
    with pytest.raises(EngineError) as exc:
        vlm.encode_inputs("What is this?", None, params(), [png((1, 1, 1)), png((2, 2, 2)), png((3, 3, 3))])
    assert exc.value.code == "invalid_request" and exc.value.param == "images"
    assert "per request" in exc.value.message
    assert decoded == []
    ids, _ = vlm.encode_inputs("What is this?", None, params(), [png((1, 1, 1)), png((2, 2, 2))])  # at the budget
    assert ids
