"""What quantized weights (`quantization: int8 | int4`) buy and cost: `python -m bench.quantization [--skip-speed]`.

Speed: our LLMEngine in fp32, bf16, int8 and int4 weights (from the fp32 checkpoint), each in a process of its own,
alternated (fp32, bf16, int8, int4, fp32, ...), generating for B = 1, 8 and 16 prompts at once exactly 64 greedy tokens
(bench/peer_engines.py `measure_engine`: the same prompts and timing as the engine-against-engine runs); the
median of each side's runs, the process's peak resident memory, and ratios against fp32 and bf16.

Accuracy: through the fused decoder, perplexity over the fixed text of bench/kv_accuracy.py and greedy agreement of
a few chat answers, each variant against the fp32 model (docs/quantization.md). Run it alone on the box: the speed
half is a measurement of memory traffic.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from bench.peer_runs import MODEL_DIR
from devstack.triton import REPO_ROOT

VARIANTS = (("float32", "none"), ("bfloat16", "none"), ("float32", "int8"), ("float32", "int4"))
ACCURACY_VARIANTS = (("float32", "none"), ("float32", "int8"), ("float32", "int4"), ("bfloat16", "none"),
                     ("bfloat16", "int8"))


def name(dtype: str, quantization: str) -> str:
    return {"float32": "fp32", "bfloat16": "bf16"}[dtype] + (f"+{quantization}" if quantization != "none" else "")


def measure_speed(dtype: str, quantization: str) -> dict[str, float]:
    from bench.peer_engines import measure_engine
    from engine.llm_engine import EngineConfig, LLMEngine

    engine = LLMEngine(EngineConfig(str(MODEL_DIR), max_slots=32, max_len=2048, dtype=dtype,
                                    quantization=quantization))
    engine.start()
    try:
        figures = measure_engine(engine)
    finally:
        engine.stop()
    figures["peak_rss_mib"], figures["rss_mib"] = memory_mib("VmHWM"), memory_mib("VmRSS")
    return figures


def memory_mib(field: str) -> float:
    """This process's resident memory now (`VmRSS`) or at its peak since its exec (`VmHWM`: ru_maxrss would carry
    the peak of the parent it was forked from across exec). The peak is the load's: the full-precision model and
    its quantized copy side by side."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) / 1024
    return float("nan")


def _run(variant: tuple[str, str], log: Path) -> dict[str, float]:
    cmd = [sys.executable, "-m", "bench.quantization", "--measure", *variant]
    with open(log, "w") as out:
        subprocess.run(cmd, cwd=REPO_ROOT, stdout=out, stderr=subprocess.STDOUT, timeout=1800, check=True)
    for line in log.read_text().splitlines():
        if line.startswith("RESULT "):
            return json.loads(line[len("RESULT "):])
    raise RuntimeError(f"{variant}: no RESULT line in {log}")


def speed(rounds: int) -> None:
    runs: dict[str, list[dict[str, float]]] = {name(*v): [] for v in VARIANTS}
    with tempfile.TemporaryDirectory(prefix="bench-quantization-") as logs:
        for n in range(rounds):
            for variant in VARIANTS:
                figures = _run(variant, Path(logs) / f"{name(*variant)}-{n}.log")
                runs[name(*variant)].append(figures)
                print(f"[{name(*variant)} {n}] " + "  ".join(f"{k} {v:.1f}" for k, v in figures.items()), flush=True)
    medians = {side: {k: statistics.median(r[k] for r in side_runs) for k in side_runs[0]}
               for side, side_runs in runs.items()}
    print("| weights | B=1 tok/s | B=8 | B=16 | RSS MiB after the runs (peak, at load) |\n|---|---|---|---|---|")
    for side, m in medians.items():
        print(f"| {side} | {m['tok_s_b1']:.1f} | {m['tok_s_b8']:.1f} | {m['tok_s_b16']:.1f} "
              f"| {m['rss_mib']:.0f} ({m['peak_rss_mib']:.0f}) |")
    for quantized in ("int8", "int4"):
        for base in ("fp32", "bf16"):
            for b in (1, 8, 16):
                ratio = medians[f"fp32+{quantized}"][f"tok_s_b{b}"] / medians[base][f"tok_s_b{b}"]
                print(f"{quantized}_over_{base}_b{b}: {ratio:.3f}")


def accuracy(tokens: int, answer_tokens: int) -> None:
    import torch

    from bench.kv_accuracy import CHUNK, all_position_logits, chat_prompts, common_prefix, fixed_text, greedy
    from engine.model.decoder import Decoder
    from engine.model.loading import load_model

    print("| model | weights | perplexity | vs fp32 | same answers | tokens before a difference |")
    print("|---|---|---|---|---|---|")
    base_nll, base_answers = None, None
    for dtype, quantization in ACCURACY_VARIANTS:
        with torch.inference_mode():
            model, tokenizer, _ = load_model(str(MODEL_DIR), getattr(torch, dtype), "cpu")
            decoder = Decoder(model, tokens + CHUNK, quantization)
            ids = tokenizer(fixed_text()).input_ids[:tokens]
            prompts = chat_prompts(tokenizer)
            cache = decoder.new_cache(1, tokens + CHUNK)
            nll = -all_position_logits(decoder, cache, ids).mean().item()
            answers = [greedy(decoder, cache, p, answer_tokens) for p in prompts]
        if base_nll is None:
            base_nll, base_answers = nll, answers
        same = sum(a == b for a, b in zip(answers, base_answers, strict=True))
        prefix = sum(common_prefix(a, b) for a, b in zip(answers, base_answers, strict=True)) / len(answers)
        print(f"| {MODEL_DIR.name} | {name(dtype, quantization)} | {math.exp(nll):.4f} | "
              f"{100 * (math.exp(nll - base_nll) - 1):+.2f}% | {same}/{len(answers)} | {prefix:.1f}/{answer_tokens} |",
              flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--measure", nargs=2, metavar=("DTYPE", "QUANTIZATION"), help=argparse.SUPPRESS)
    parser.add_argument("--rounds", type=int, default=2, help="alternated runs of each variant")
    parser.add_argument("--skip-speed", action="store_true")
    parser.add_argument("--skip-accuracy", action="store_true")
    parser.add_argument("--tokens", type=int, default=3000, help="tokens of the fixed text")
    parser.add_argument("--answer-tokens", type=int, default=64)
    args = parser.parse_args()
    if args.measure:
        print("RESULT " + json.dumps(measure_speed(*args.measure)), flush=True)
        return
    if not args.skip_accuracy:
        accuracy(args.tokens, args.answer_tokens)
    if not args.skip_speed:
        speed(args.rounds)


if __name__ == "__main__":
    main()
