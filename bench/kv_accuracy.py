"""What a narrower KV cache costs in accuracy: `python -m bench.kv_accuracy [--model NAME] [--dtype D] [--tokens N]`.

Through the engine's own decoder (the fused forward, or the transformers path where `auto` picks it), the same
model with its KV cache in fp32 (`auto`) and in each other `kv_cache_dtype`:
- perplexity over a fixed text: the first `--tokens` tokens of the Python language reference's section "The
  standard type hierarchy" (`pydoc_data.topics`, shipped with CPython, so the text is the same on every box with the
  same Python), prefilled in chunks of 512 as the scheduler's budget would, so later chunks read the earlier ones'
  K/V from the pool;
- greedy agreement: a few chat prompts answered with 64 greedy tokens, each answer compared with the fp32-KV one
  (identical answers, and the mean tokens before the first difference).
fp8 K/V, which the engine does not store, are simulated on an fp32 pool: every key and value is rounded to
`fp8_e4m3` (vLLM's default scale of 1) as it is written (the prefill's writes and the decode kernel's), and the
attention then computes in fp32 over those values, as a kernel that widens fp8 K/V in registers would.
Prints a markdown table (docs/kv-memory.md, "Accuracy"). One model, a few thousand tokens: light enough to run on a
busy box, but it is a measurement, so run it where nothing else competes if its time matters to you.
"""

from __future__ import annotations

import argparse
import contextlib
import math
import os
from collections.abc import Callable, Iterator
from pathlib import Path

import torch

from engine.model import decoder as fused_decoder
from engine.model.kv_cache import KV_CACHE_DTYPES, KVCache
from engine.model.loading import load_model
from engine.model.selection import build_decoder

PROMPTS = ["What is the capital of France, and what is it known for?",
           "Write a short poem about the sea.",
           "Explain in two sentences why the sky is blue.",
           "List three tips for learning a new language."]
ANSWER_TOKENS = 64
CHUNK = 512


def fixed_text() -> str:
    from pydoc_data.topics import topics

    return topics["types"]


def chat_prompts(tokenizer) -> list[list[int]]:
    """PROMPTS as the model's chat template asks (plain text for a model without one), tokenized."""
    texts = [tokenizer.apply_chat_template([{"role": "user", "content": p}], add_generation_prompt=True,
                                           tokenize=False) if tokenizer.chat_template else p for p in PROMPTS]
    return [tokenizer(t, add_special_tokens=not tokenizer.chat_template).input_ids for t in texts]


def all_position_logits(decoder, cache, ids: list[int]) -> torch.Tensor:
    """Log-probabilities of each next token of `ids` [len - 1], prefilled chunk by chunk into slot 0."""
    captured: list[torch.Tensor] = []
    name = "_layers" if hasattr(decoder, "_layers") else "_hidden"  # the fused forward's or the transformers path's
    inner = getattr(decoder, name)

    def recording(*args, **kwargs):
        captured.append(inner(*args, **kwargs))
        return captured[-1]

    setattr(decoder, name, recording)
    try:
        for start in range(0, len(ids), CHUNK):
            decoder.prefill(cache, 0, ids[start : start + CHUNK], start, sample=False)
    finally:
        delattr(decoder, name)
    hidden = torch.cat(captured)
    targets = torch.tensor(ids[1:])
    out = []
    for a in range(0, len(ids) - 1, 256):  # the LM head 256 positions at a time
        logits = decoder.logits(hidden[a : min(a + 256, len(ids) - 1)])
        out.append(logits.log_softmax(-1).gather(1, targets[a : a + logits.shape[0], None])[:, 0])
    return torch.cat(out)


def greedy(decoder, cache, prompt: list[int], length: int) -> list[int]:
    logits = decoder.prefill(cache, 0, prompt, 0)
    tokens = [int(logits.argmax())]
    for pos in range(len(prompt), len(prompt) + length - 1):
        hidden = decoder.decode_hidden(cache, torch.tensor([tokens[-1]]), torch.tensor([pos]), span=pos + 1)
        tokens.append(int(decoder.logits(hidden)[0].argmax()))
    return tokens


def _fp8_e4m3(x: torch.Tensor) -> torch.Tensor:
    return x.clamp(-448, 448).to(torch.float8_e4m3fn).to(x.dtype)


# name -> (rounding, K/V bytes of a KV head's D values)
SIMULATED: dict[str, tuple[Callable[[torch.Tensor], torch.Tensor], Callable[[int], int]]] = {
    "fp8_e4m3": (_fp8_e4m3, lambda d: d)}


@contextlib.contextmanager
def _simulated(rounding: Callable[[torch.Tensor], torch.Tensor]) -> Iterator[None]:
    """Every K/V write rounded by `rounding` first: `KVCache.write` (prefill, the SDPA and transformers paths) and
    the fused decode step's kernel, which writes its rows itself."""
    write, decode = KVCache.write, fused_decoder.decode_attention

    def rounded_write(self, layer, block, offset, k, v):
        write(self, layer, block, offset, rounding(k), rounding(v))

    def rounded_decode(q, k, v, *args, **kwargs):
        return decode(q, rounding(k), rounding(v), *args, **kwargs)

    KVCache.write, fused_decoder.decode_attention = rounded_write, rounded_decode
    try:
        yield
    finally:
        KVCache.write, fused_decoder.decode_attention = write, decode


def common_prefix(a: list[int], b: list[int]) -> int:
    return next((i for i, (x, y) in enumerate(zip(a, b, strict=True)) if x != y), len(a))


@torch.inference_mode()
def measure(model_dir: Path, dtype: str, tokens: int, kv_dtypes: list[str], answer_tokens: int) -> list[str]:
    model, tokenizer, _ = load_model(str(model_dir), getattr(torch, dtype), "cpu")
    decoder = build_decoder(model, "auto", tokens + CHUNK)
    ids = tokenizer(fixed_text()).input_ids[:tokens]
    prompts = chat_prompts(tokenizer)
    rows, base_nll, base_answers = [], 0.0, []
    for kv in [*kv_dtypes, *SIMULATED]:
        rounding, value_bytes = SIMULATED.get(kv, (None, None))
        cache = decoder.new_cache(1, tokens + CHUNK, kv_dtype="auto" if rounding else kv)
        with _simulated(rounding) if rounding else contextlib.nullcontext():
            nll = -all_position_logits(decoder, cache, ids).mean().item()
            answers = [greedy(decoder, cache, p, answer_tokens) for p in prompts]
        if kv == "auto":
            base_nll, base_answers = nll, answers
        same = sum(a == b for a, b in zip(answers, base_answers, strict=True))
        prefix = sum(common_prefix(a, b) for a, b in zip(answers, base_answers, strict=True)) / len(answers)
        layers, _, heads, _, dim = cache.k.shape
        per_token = 2 * layers * heads * value_bytes(dim) if value_bytes else cache.bytes_per_token()
        storage = "simulated" if rounding else str(cache.k.dtype).removeprefix("torch.")
        rows.append(f"| {model_dir.name} | {dtype} ({type(decoder).__name__}) | `{kv}` ({storage}) | "
                    f"{per_token:,} | {math.exp(nll):.4f} | {100 * (math.exp(nll - base_nll) - 1):+.2f}% "
                    f"| {same}/{len(answers)} | {prefix:.1f}/{answer_tokens} |")
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="SmolLM2-135M-Instruct", help="a folder under SIE_MODEL_CACHE")
    parser.add_argument("--dtype", action="append", help="weights' dtype (repeatable; default float32)")
    parser.add_argument("--tokens", type=int, default=3000, help="tokens of the fixed text")
    parser.add_argument("--answer-tokens", type=int, default=ANSWER_TOKENS, help="greedy tokens an answer")
    args = parser.parse_args()
    cache_dir = Path(os.environ.get("SIE_MODEL_CACHE") or Path(__file__).resolve().parents[1] / ".cache" / "models")
    print("| model | weights (path) | kv_cache_dtype | K/V bytes a token | perplexity | vs fp32 KV | same answers "
          "| tokens before a difference |")
    print("|---|---|---|---|---|---|---|---|")
    for dtype in args.dtype or ["float32"]:
        for row in measure(cache_dir / args.model, dtype, args.tokens, list(KV_CACHE_DTYPES), args.answer_tokens):
            print(row, flush=True)


if __name__ == "__main__":
    main()
