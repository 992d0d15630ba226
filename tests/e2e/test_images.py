"""Image input end to end: gateway edge decoding -> Triton `images` tensor -> the tiny Llava's processor and model."""

from __future__ import annotations

import base64
import io
import json

import httpx

from tests.e2e.conftest import MODEL, SIE_MODEL
from tests.helpers.sse import DONE, data_payloads

VLM = "sie-test/tiny-llava"
SIE_VLM = "sie-test__tiny-llava"


def png(color: tuple[int, int, int], size: tuple[int, int] = (32, 24)) -> bytes:
    from PIL import Image

    buf = io.BytesIO()
    Image.new("RGB", size, color).save(buf, format="PNG")
    return buf.getvalue()


def b64(data: bytes) -> str:
    return base64.b64encode(data).decode("ascii")


def data_uri(data: bytes) -> str:
    return "data:image/png;base64," + b64(data)


def chat_body(model: str, **extra) -> dict:
    content = [{"type": "text", "text": "What is in this picture?"},
               {"type": "image_url", "image_url": {"url": data_uri(png((255, 0, 0)))}}]
    return {"model": model, "messages": [{"role": "user", "content": content}], "max_tokens": 8, "seed": 1, **extra}


def test_vlm_is_listed_with_image_input(stack):
    r = httpx.get(f"{stack.base_url}/v1/models", timeout=30)
    assert r.status_code == 200, r.text
    assert VLM in json.dumps(r.json())


def test_chat_with_an_image_on_the_vlm(stack):
    r = httpx.post(f"{stack.base_url}/v1/chat/completions", json=chat_body(VLM), timeout=60)
    assert r.status_code == 200, r.text
    body = r.json()
    choice = body["choices"][0]
    assert isinstance(choice["message"]["content"], str)
    assert choice["finish_reason"] in ("stop", "length")
    # 16 image tokens per image (64x64, patch 16) are part of the prompt
    assert body["usage"]["prompt_tokens"] > 16 and body["usage"]["completion_tokens"] > 0


def test_chat_with_an_image_streams(stack):
    with httpx.stream("POST", f"{stack.base_url}/v1/chat/completions", json=chat_body(VLM, stream=True),
                      timeout=60) as r:
        assert r.status_code == 200
        payloads = list(data_payloads(r.iter_lines()))
    assert payloads[-1] == "[DONE]"
    chunks = [json.loads(p) for p in payloads[:-1]]
    assert chunks[-1]["choices"][0]["finish_reason"] in ("stop", "length")


def test_native_generate_with_images_counts_them(stack):
    body = {"prompt": "Describe the image.", "max_new_tokens": 8, "temperature": 0,
            "images": [{"data": b64(png((0, 0, 255))), "format": "png"}]}
    r = httpx.post(f"{stack.base_url}/v1/generate/{SIE_VLM}", json=body, timeout=60)
    assert r.status_code == 200, r.text
    out = r.json()
    assert out["model"] == VLM
    assert isinstance(out["text"], str)
    assert out["usage"]["images"] == 1
    assert out["usage"]["completion_tokens"] > 0 and out["usage"]["prompt_tokens"] > 16


def test_the_vlm_sees_the_pixels(stack):
    """Greedy, same prompt, different images: the first token's distribution differs."""

    def first_logprobs(color):
        body = {"prompt": "Describe the image.", "max_new_tokens": 1, "temperature": 0, "stream": True,
                "logprobs": True, "top_logprobs": 5, "images": [{"data": b64(png(color)), "format": "png"}]}
        with httpx.stream("POST", f"{stack.base_url}/v1/generate/{SIE_VLM}", json=body, timeout=60) as r:
            assert r.status_code == 200
            events = [json.loads(p) for p in data_payloads(r.iter_lines()) if p != DONE]
        entries = [lp for e in events for lp in (e.get("logprobs") or [])]
        return [(t["token"], round(t["logprob"], 5)) for t in entries[0]["top_logprobs"]]

    red, blue = first_logprobs((255, 0, 0)), first_logprobs((0, 0, 255))
    assert red == first_logprobs((255, 0, 0))
    assert red != blue


def test_native_generate_without_images_on_the_vlm(stack):
    r = httpx.post(f"{stack.base_url}/v1/generate/{SIE_VLM}",
                   json={"prompt": "Hello", "max_new_tokens": 4}, timeout=60)
    assert r.status_code == 200, r.text
    assert "images" not in r.json()["usage"]


def test_corrupt_image_is_rejected_by_the_engine(stack):
    body = {"prompt": "Describe the image.", "max_new_tokens": 4,
            "images": [{"data": b64(b"this is not a png"), "format": "png"}]}
    r = httpx.post(f"{stack.base_url}/v1/generate/{SIE_VLM}", json=body, timeout=60)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["code"] == "invalid_request"


def test_text_model_rejects_chat_images(stack):
    r = httpx.post(f"{stack.base_url}/v1/chat/completions", json=chat_body(MODEL), timeout=30)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["code"] == "unsupported_field"
    assert err["param"] == "messages[0].content[1].type"


def test_text_model_rejects_native_images(stack):
    body = {"prompt": "Describe the image.", "max_new_tokens": 4,
            "images": [{"data": b64(png((0, 0, 255))), "format": "png"}]}
    r = httpx.post(f"{stack.base_url}/v1/generate/{SIE_MODEL}", json=body, timeout=30)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["code"] == "unsupported_field" and err["param"] == "images"
