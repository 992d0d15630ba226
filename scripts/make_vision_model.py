"""Build the tiny vision-language test model once (tests and the second served model use it).

A real transformers architecture (LlavaForConditionalGeneration: a small CLIP vision tower, the
Llava projector and a small Llama language model) with random weights, so the image path can be
proven end to end without a download; its words are noise. The vocabulary is SmolLM2's tokenizer
plus an `<image>` special token; a LlavaProcessor (CLIP image processor sized to the vision tower,
that tokenizer, a ChatML template that puts `<image>` placeholders before the user text) is saved
next to it. Idempotent (a `.complete` marker); takes a few seconds.
"""

from __future__ import annotations

import argparse
import os
import pathlib
import shutil

IMAGE_SIZE = 64
PATCH_SIZE = 16
IMAGE_TOKEN = "<image>"

# ChatML like SmolLM2's, no default system prompt. A message's content is a string or a list of
# parts ({"type": "image"} / {"type": "text", "text": ...}); image placeholders come first.
CHAT_TEMPLATE = (
    "{%- for message in messages -%}"
    "{{- '<|im_start|>' + message['role'] + '\\n' -}}"
    "{%- if message['content'] is string -%}"
    "{{- message['content'] -}}"
    "{%- else -%}"
    "{%- for part in message['content'] -%}{%- if part['type'] == 'image' -%}{{- '<image>' -}}{%- endif -%}"
    "{%- endfor -%}"
    "{%- for part in message['content'] -%}{%- if part['type'] == 'text' -%}{{- part['text'] -}}{%- endif -%}"
    "{%- endfor -%}"
    "{%- endif -%}"
    "{{- '<|im_end|>\\n' -}}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{- '<|im_start|>assistant\\n' -}}{%- endif -%}"
)


def default_out() -> pathlib.Path:
    cache = os.environ.get("SIE_MODEL_CACHE") or str(pathlib.Path(__file__).resolve().parents[1] / ".cache" / "models")
    return pathlib.Path(cache) / "tiny-llava"


def build(tokenizer_dir: pathlib.Path, out: pathlib.Path) -> None:
    marker = out / ".complete"
    if marker.exists():
        print(f"tiny vision model already built at {out}")
        return
    import torch
    from tqdm import tqdm
    from transformers import (
        AutoTokenizer,
        CLIPVisionConfig,
        LlamaConfig,
        LlavaConfig,
        LlavaForConditionalGeneration,
        LlavaProcessor,
    )
    from transformers.models.clip.image_processing_pil_clip import CLIPImageProcessorPil

    steps = tqdm(total=4, desc="building tiny-llava")
    torch.manual_seed(0)
    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
    tokenizer.add_special_tokens({"additional_special_tokens": [IMAGE_TOKEN]})
    tokenizer.chat_template = CHAT_TEMPLATE
    image_token_id = tokenizer.convert_tokens_to_ids(IMAGE_TOKEN)
    steps.update()

    vision = CLIPVisionConfig(
        image_size=IMAGE_SIZE, patch_size=PATCH_SIZE, hidden_size=64, intermediate_size=128,
        num_hidden_layers=2, num_attention_heads=2, projection_dim=64,
    )
    text = LlamaConfig(
        vocab_size=len(tokenizer), hidden_size=128, intermediate_size=256, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=32, max_position_embeddings=2048,
        rms_norm_eps=1e-5, bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id, tie_word_embeddings=False,
    )
    config = LlavaConfig(
        vision_config=vision, text_config=text, image_token_id=image_token_id,
        vision_feature_layer=-1, vision_feature_select_strategy="default", projector_hidden_act="gelu",
    )
    model = LlavaForConditionalGeneration(config).eval()
    steps.update()

    image_processor = CLIPImageProcessorPil(
        size={"shortest_edge": IMAGE_SIZE}, crop_size={"height": IMAGE_SIZE, "width": IMAGE_SIZE},
    )
    processor = LlavaProcessor(
        image_processor=image_processor, tokenizer=tokenizer, patch_size=PATCH_SIZE,
        vision_feature_select_strategy="default", num_additional_image_tokens=1,  # CLIP's CLS token
        chat_template=CHAT_TEMPLATE, image_token=IMAGE_TOKEN,
    )
    tmp = out.with_name(out.name + ".partial")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    model.save_pretrained(tmp)
    steps.update()
    processor.save_pretrained(tmp)
    tokenizer.save_pretrained(tmp)
    steps.update()
    steps.close()
    shutil.rmtree(out, ignore_errors=True)
    tmp.rename(out)
    marker.write_text("ok\n")
    print(f"tiny vision model built at {out}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--tokenizer", type=pathlib.Path, default=default_out().parent / "SmolLM2-135M-Instruct",
                        help="the SmolLM2 folder whose tokenizer is copied")
    parser.add_argument("--out", type=pathlib.Path, default=default_out())
    args = parser.parse_args()
    build(args.tokenizer, args.out)


if __name__ == "__main__":
    main()
