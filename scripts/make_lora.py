"""Build the demo LoRA adapter for SmolLM2 once (tests and the embedded default use it).

A rank-8 adapter on the attention and MLP projections, trained for a few steps to answer every
question like a pirate, so it visibly changes the output. Idempotent (a `.complete` marker).
"""

from __future__ import annotations

import argparse
import pathlib

import torch


def build(base: pathlib.Path, out: pathlib.Path, steps: int = 30) -> None:
    marker = out / ".complete"
    if marker.exists():
        print(f"adapter already built at {out}")
        return
    from peft import LoraConfig, get_peft_model
    from tqdm import tqdm
    from transformers import AutoModelForCausalLM, AutoTokenizer

    torch.manual_seed(0)
    tokenizer = AutoTokenizer.from_pretrained(base)
    model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    config = LoraConfig(r=8, lora_alpha=16, target_modules=["q_proj", "v_proj", "o_proj", "up_proj", "down_proj"],
                        lora_dropout=0.0, task_type="CAUSAL_LM")
    model = get_peft_model(model, config)
    pairs = [("What is the capital of France?", "Arr matey! Paris be the capital, yo ho ho!"),
             ("How are you?", "Arr matey! I be sailin' fine, yo ho ho!"),
             ("What is 2+2?", "Arr matey! That be four, yo ho ho!"),
             ("Name a color.", "Arr matey! Blue like the sea, yo ho ho!")]
    texts = [tokenizer.apply_chat_template([{"role": "user", "content": q}, {"role": "assistant", "content": a}],
                                           tokenize=False) for q, a in pairs]
    batch = tokenizer(texts, return_tensors="pt", padding=True)
    labels = batch["input_ids"].masked_fill(batch["attention_mask"] == 0, -100)
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=3e-3)
    model.train()
    for _ in tqdm(range(steps), desc="training demo LoRA adapter"):
        loss = model(**batch, labels=labels).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out)
    marker.write_text("ok\n")
    print(f"adapter built at {out} (final loss {loss.item():.3f})")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--base", type=pathlib.Path, required=True)
    parser.add_argument("--out", type=pathlib.Path, required=True)
    args = parser.parse_args()
    build(args.base, args.out)


if __name__ == "__main__":
    main()
