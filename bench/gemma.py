"""Gemma 3 270M on the transformers model path (engine/model/transformers_decoder.py), against HF in the same run.

The same workload and figures as bench/engine.py (greedy, exactly 64 new tokens, median of the repetitions),
on 8 raw-text prompts (Gemma 3 270M is a base model): HF `generate` one prompt at a time and as a static
batch of 8, and the engine at 1, 8 and 16 concurrent requests, all on the same weights in one process.

Run: `.venv/bin/python -m bench.gemma` (part of `make bench`). Results: bench/results/gemma.json.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from pathlib import Path

import torch

from bench.engine import NEW_TOKENS, Bench
from engine.llm_engine import EngineConfig, LLMEngine

REPO = Path(__file__).resolve().parents[1]
GEMMA_DIR = Path(os.environ.get("SIE_MODEL_CACHE") or REPO / ".cache" / "models") / "gemma-3-270m"
RESULTS = REPO / "bench" / "results" / "gemma.json"
PROMPTS = [
    "The capital of France is",
    "Once upon a time, in a small village by the sea,",
    "The three primary colours are",
    "Honey bees make honey by",
    "A black hole is a region of space where",
    "To cook pasta, first",
    "Gravity is the force that",
    "On a sunny beach you can",
]


class GemmaBench(Bench):
    """bench.engine's figures on Gemma: the same HF and engine helpers, a different engine and prompts."""

    def __init__(self, reps: int) -> None:
        self.reps = reps
        torch.set_num_threads(2)
        t0 = time.perf_counter()
        self.engine = LLMEngine(EngineConfig(str(GEMMA_DIR), max_slots=32, max_len=256, threads=2))
        self.engine.start()
        self.load_s = time.perf_counter() - t0
        self.tok = self.engine.tokenizer
        self.model = self.engine.model
        self.prompts = [self.engine.encode_prompt(p) for p in PROMPTS]
        self._rid = 0

    def hf_generate(self, batch: list[list[int]], new_tokens: int = NEW_TOKENS):
        with self.engine.runner.decoder.hf_attention():  # HF's own sdpa, as HF serves it
            return super().hf_generate(batch, new_tokens)

    def warm_up(self) -> None:
        self.hf_generate(self.prompts[:1], 8)
        self.hf_generate(self.prompts, 8)
        self.engine_tps(self.prompts)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--reps", type=int, default=3)
    args = parser.parse_args()
    if not (GEMMA_DIR / "config.json").exists():
        raise SystemExit(f"Gemma 3 not prepared at {GEMMA_DIR} (run `make model`)")
    b = GemmaBench(args.reps)
    print(f"model: {GEMMA_DIR.name} fp32 on {type(b.engine.runner.decoder).__name__}, load {b.load_s:.1f} s")
    t0 = time.perf_counter()
    b.warm_up()
    r = b.sequential_and_c1()
    r["hf_static_c8_tps"] = b.static_batch()
    for c in (8, 16):
        r[f"engine_c{c}_tps"] = b.concurrency(c)
    r["total_s"] = time.perf_counter() - t0
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    RESULTS.write_text(json.dumps(r, indent=2))
    print(f"gemma_hf_sequential_tps: {r['hf_sequential_tps']:.2f}")
    print(f"gemma_hf_static_c8_tps: {r['hf_static_c8_tps']:.2f}")
    for c in (1, 8, 16):
        print(f"gemma_engine_c{c}_tps: {r[f'engine_c{c}_tps']:.2f}")
    print(f"gemma_engine_speedup_c1: {r['engine_speedup_c1']:.2f}")
    print(f"gemma_static_batch_ratio_c8: {r['engine_c8_tps'] / r['hf_static_c8_tps']:.2f}")
    print(f"gemma_greedy_first16_match_hf: {r['greedy_first16_match_hf']} prompts")
    print(f"gemma_c1_tps_spread: {min(r['engine_c1_tps_all']):.2f}..{max(r['engine_c1_tps_all']):.2f}, "
          f"median {statistics.median(r['engine_c1_tps_all']):.2f}; total_s {r['total_s']:.0f}")


if __name__ == "__main__":
    main()
