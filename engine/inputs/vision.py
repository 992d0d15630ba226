"""Image input for Llava-style vision-language models, on the same Decoder path as text.

A vision model (engine.model.loading) is loaded with its processor;
Decoder runs its language model (`model.model.language_model` + `model.lm_head`). For a
request with images the prompt is rendered through the chat template with `<image>` placeholders
(one user turn for a native prompt; before the text of the last user message for chat), the
processor expands the placeholders and makes `pixel_values`, and the prompt's input embeddings
are computed once here: token embeddings with the vision tower + projector features
(`get_image_features`) scattered into the image-token positions. The scheduler feeds the matching
slice of them to each prefill chunk; decode is plain token embeddings.
"""

from __future__ import annotations

import io
from typing import Any

import torch

from engine.errors import EngineError
from engine.text.chat import render_chat

# decoded RGB costs 3 bytes a pixel (and a copy per conversion): 16 images of 9000x9000 took a model process from
# 0.6 to 9.8 GB before these bounds. Llava-style processors resize to a few hundred pixels a side anyway.
MAX_IMAGE_PIXELS = 4096 * 4096
MAX_REQUEST_PIXELS = 2 * MAX_IMAGE_PIXELS


def decode_images(images: list[bytes], max_image_pixels: int = MAX_IMAGE_PIXELS,
                  max_request_pixels: int = MAX_REQUEST_PIXELS) -> list[Any]:
    """Raw image file bytes -> RGB PIL images; anything Pillow cannot decode is the request's fault.

    Every image's size is read from its header (Image.open decodes nothing) and checked against the per-image
    and per-request pixel budgets before any image is decoded."""
    from PIL import Image

    opened = []
    total = 0
    try:
        for i, data in enumerate(images):
            try:
                img = Image.open(io.BytesIO(data))
            except Exception as exc:
                raise _undecodable(i, exc) from None
            opened.append(img)
            width, height = img.size
            total += width * height
            if width * height > max_image_pixels:
                raise EngineError("invalid_request", f"image {i} is {width}x{height} pixels; this model accepts "
                                  f"at most {max_image_pixels} pixels per image", "images")
            if total > max_request_pixels:
                raise EngineError("invalid_request", f"the images add up to more than {max_request_pixels} "
                                  "pixels, this model's budget per request", "images")
        out = []
        for i, img in enumerate(opened):
            try:
                img.load()
                out.append(img.convert("RGB"))
            except Exception as exc:
                raise _undecodable(i, exc) from None
        return out
    finally:
        for img in opened:
            img.close()


def _undecodable(index: int, exc: Exception) -> EngineError:
    # the param is the image's place; the gateway names the client's field for it (messages[i].content[j]...)
    return EngineError("invalid_request", f"image {index} is not an image this model can decode", f"images[{index}]")


def with_image_parts(messages: list[dict[str, Any]], count: int) -> list[dict[str, Any]]:
    """Put `count` image parts before the text of the last user message."""
    for index in range(len(messages) - 1, -1, -1):
        if messages[index].get("role") == "user":
            break
    else:
        raise EngineError("invalid_request", "images need a user message to attach to", "messages")
    message = dict(messages[index])
    text = message.get("content")
    parts = [{"type": "image"} for _ in range(count)]
    if isinstance(text, list):
        parts += [p for p in text if p.get("type") != "image"]
    else:
        parts.append({"type": "text", "text": text or ""})
    message["content"] = parts
    return [*messages[:index], message, *messages[index + 1:]]


class VisionPrompter:
    """Turns a prompt or chat plus images into (prompt token ids, prompt input embeddings)."""

    def __init__(self, hf_model: torch.nn.Module, processor: Any, tokenizer: Any, embed: torch.Tensor) -> None:
        self.model = hf_model
        self.processor = processor
        self.tokenizer = tokenizer
        self.embed = embed  # the language model's token embedding table (Decoder's)
        self.max_image_pixels, self.max_request_pixels = MAX_IMAGE_PIXELS, MAX_REQUEST_PIXELS
        config = hf_model.config
        self.image_token_id = getattr(config, "image_token_id", None)
        if self.image_token_id is None:
            self.image_token_id = config.image_token_index
        param = next(hf_model.parameters())
        self.device, self.dtype = param.device, param.dtype

    def encode(
        self,
        prompt: str | None,
        messages: list[dict[str, Any]] | None,
        params: Any,
        images: list[bytes],
    ) -> tuple[list[int], torch.Tensor]:
        pil_images = decode_images(images, self.max_image_pixels, self.max_request_pixels)
        if messages is None:
            if prompt is None:
                raise EngineError("invalid_request", "either a prompt or messages is required", "prompt")
            messages = [{"role": "user", "content": prompt}]  # native generate: one user turn
        tools = params.tools if params is not None and params.tool_choice != "none" else None
        kwargs = params.chat_template_kwargs if params is not None else None
        chat = render_chat(self.tokenizer, with_image_parts(messages, len(pil_images)), tools, kwargs)
        try:
            enc = self.processor(text=chat.text, images=pil_images, return_tensors="pt", add_special_tokens=False)
        except EngineError:
            raise
        except Exception as exc:
            raise EngineError("invalid_request", f"images could not be processed: {exc}", "images") from None
        ids = chat.splice(self.tokenizer, enc["input_ids"][0].tolist())  # forged control tokens -> plain text
        return ids, self.embeddings(torch.tensor(ids), enc["pixel_values"])

    @torch.inference_mode()
    def image_features(self, pixel_values: torch.Tensor) -> torch.Tensor:
        """[images, 3, H, W] -> [image tokens, hidden] through the vision tower and the projector."""
        out = self.model.get_image_features(pixel_values=pixel_values.to(self.device, self.dtype))
        feats = getattr(out, "pooler_output", out)
        if isinstance(feats, (list, tuple)):
            feats = torch.cat([f.reshape(-1, f.shape[-1]) for f in feats])
        return feats.reshape(-1, feats.shape[-1])

    @torch.inference_mode()
    def embeddings(self, ids: torch.Tensor, pixel_values: torch.Tensor) -> torch.Tensor:
        """Prompt input embeddings [T, hidden]: token embeddings with image features at image tokens."""
        ids = ids.to(self.embed.device)
        h = self.embed[ids].clone()
        feats = self.image_features(pixel_values).to(h.dtype)
        mask = ids == self.image_token_id
        if int(mask.sum()) != feats.shape[0]:
            raise EngineError(
                "invalid_request",
                f"the prompt has {int(mask.sum())} image tokens for {feats.shape[0]} image features",
                "images",
            )
        h[mask] = feats
        return h
