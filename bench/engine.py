"""Engine benchmark: continuous-batching engine vs HF `generate`, measured side by side in one run.

Workload: SmolLM2-135M-Instruct, fp32 (`--dtype bfloat16`: the bf16 profile, HF in bf16 too), both cores, 8 chat
prompts of about 35 prompt tokens (chat template applied), greedy, exactly 64 new tokens each (EOS ignored), median
of 3 after a warm-up.

Figures (tok/s count generated tokens over wall time from submission to the last token, prefill included,
identically for HF and the engine):
  hf_sequential     HF `generate` of the 8 prompts one at a time (min_new_tokens = max_new_tokens = 64).
                    It is the slowest baseline, so it runs one pass: each prompt is timed once, interleaved
                    with the engine's c1 run of the same prompt, and the figure is the median over the 8
                    per-prompt rates (engine_speedup_c1 is the median of the 8 paired ratios).
  hf_static_c8      HF `generate` of the 8 prompts as one left-padded batch.
  engine_cN         N concurrent requests (16 = the 8 prompts twice).
  step_bN_ms        one pure decode step of N rows in those runs, by phase (engine/core/step_timing.py).
  late_ttft_s       time to the first output of a request submitted while 6 others are decoding.
  features_ratio_c8 tok/s with every sampler feature on over plain greedy, both at 8 concurrent (the median of 5
                    paired runs; the grammar and LoRA row ratios likewise).
  n4_ratio          wall time of one n=4 request over 4 separate concurrent requests of the same prompt.

Run: `.venv/bin/python -m bench.engine` (about 5 minutes on the 2-core box). Results: bench/results/engine.json.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import queue
import statistics
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch

from engine.core.step_timing import PHASES
from engine.llm_engine import EngineConfig, LLMEngine
from engine.sampling_params import GrammarRequest, SamplingParams

REPO = Path(__file__).resolve().parents[1]
MODEL_DIR = Path(os.environ.get("SIE_MODEL_CACHE") or REPO / ".cache" / "models") / "SmolLM2-135M-Instruct"
RESULTS = REPO / "bench" / "results" / "engine.json"
LORA_DIR = MODEL_DIR.parent / "smollm2-lora-pirate"
# grammar row: an unbounded regex, so that with EOS ignored every row still generates exactly 64 tokens
GRAMMAR = GrammarRequest(kind="regex", value="[A-Za-z0-9 ,.!?'-]+")
NEW_TOKENS = 64

# Short user turns: with SmolLM2's default system prompt the rendered prompts are 35-37 tokens.
PROMPTS = [
    "Why is the sky blue?",
    "Write a haiku about rain.",
    "Name three primary colors.",
    "How do bees make honey?",
    "What is a black hole?",
    "Give me a pasta recipe.",
    "Explain gravity to a child.",
    "Describe a sunny beach.",
]


def greedy_params(**extra) -> SamplingParams:
    return SamplingParams(**{"ignore_eos": True, "temperature": 0.0, "max_tokens": NEW_TOKENS, **extra})


def features_params(i: int) -> SamplingParams:
    """Every per-row sampler feature on at once."""
    return SamplingParams(
        ignore_eos=True,
        max_tokens=NEW_TOKENS,
        temperature=0.7,
        top_k=50,
        top_p=0.95,
        seed=1234 + i,
        logprobs=True,
        top_logprobs=5,
        logit_bias={28: -100.0, 30: 2.0, 1075: -5.0},
        presence_penalty=0.5,
        frequency_penalty=0.3,
        repetition_penalty=1.1,
    )


class Collector:
    """Drains one request's output queue on the caller side; records first-output and final times."""

    def __init__(self, q: queue.Queue, submitted: float) -> None:
        self.q = q
        self.submitted = submitted
        self.first: float | None = None
        self.done: float | None = None
        self.outputs = []

    def wait(self) -> Collector:
        while True:
            out = self.q.get(timeout=300)
            now = time.perf_counter()
            if self.first is None:
                self.first = now
            self.outputs.append(out)
            if out.error is not None:
                raise RuntimeError(f"request failed: {out.error.code}: {out.error.message}")
            if out.final:
                self.done = now
                return self

    def tokens(self) -> int:
        return sum(o.completion_tokens for o in self.outputs if o.finish_reason is not None)


class Bench:
    def __init__(self, reps: int, dtype: str = "float32") -> None:
        self.reps = reps
        torch.set_num_threads(2)
        t0 = time.perf_counter()
        self.lora = (LORA_DIR / "adapter_config.json").exists()
        loras = {"pirate": str(LORA_DIR)} if self.lora else None
        self.engine = LLMEngine(EngineConfig(str(MODEL_DIR), max_slots=32, max_len=256, threads=2, lora_paths=loras,
                                             dtype=dtype))
        self.engine.start()
        self.load_s = time.perf_counter() - t0
        self.tok = self.engine.tokenizer
        self.model = self.engine.model  # the same HF weights the engine reads
        msgs = [[{"role": "user", "content": p}] for p in PROMPTS]
        self.prompts = [self.engine.encode_prompt(messages=m) for m in msgs]
        self._rid = 0

    # -- engine helpers -----------------------------------------------------------------------

    def submit(self, prompt_ids: list[int], params: SamplingParams) -> Collector:
        self._rid += 1
        t = time.perf_counter()
        q = self.engine.generate(f"b{self._rid}", prompt_ids, params)
        return Collector(q, t)

    def engine_run(self, prompts: list[list[int]], make_params) -> tuple[float, int, list[Collector]]:
        """Submit all at once; returns (wall seconds, generated tokens, collectors)."""
        t0 = time.perf_counter()
        cols = [self.submit(p, make_params(i)) for i, p in enumerate(prompts)]
        for c in cols:
            c.wait()
        wall = max(c.done for c in cols) - t0
        return wall, sum(c.tokens() for c in cols), cols

    def engine_tps(self, prompts, make_params=lambda i: greedy_params()) -> float:
        wall, tokens, _ = self.engine_run(prompts, make_params)
        assert tokens == NEW_TOKENS * len(prompts), tokens
        return tokens / wall

    # -- HF helpers ---------------------------------------------------------------------------

    def hf_generate(self, batch: list[list[int]], new_tokens: int = NEW_TOKENS) -> tuple[float, torch.Tensor]:
        """HF `generate` of `batch`, timed, on a thread of its own while the engine's loop thread is stopped.

        Why: libgomp gives every thread that runs parallel work a team of its own, and once a process holds more
        OpenMP threads than CPUs it cuts every worker's spin-wait to about 100 spins (engine/llm_engine.py,
        `_one_thread_here_then`). HF on the main thread beside the loop thread's team slowed both: the engine's
        B=1 forward took 43.6 ms on its loop thread against 30.6 ms on the main thread (2-core box). A thread's
        team goes when the thread ends, so each side here runs with the only team in the process."""
        self.engine.stop()
        try:
            with ThreadPoolExecutor(1, thread_name_prefix="hf-baseline") as alone:
                return alone.submit(self._hf_generate, batch, new_tokens).result()
        finally:
            self.engine.start()

    @torch.inference_mode()
    def _hf_generate(self, batch: list[list[int]], new_tokens: int) -> tuple[float, torch.Tensor]:
        width = max(len(p) for p in batch)
        pad = self.tok.pad_token_id if self.tok.pad_token_id is not None else self.model.config.eos_token_id
        ids = torch.tensor([[pad] * (width - len(p)) + p for p in batch])  # left padding
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in batch])
        t0 = time.perf_counter()
        out = self.model.generate(
            input_ids=ids,
            attention_mask=mask,
            max_new_tokens=new_tokens,
            min_new_tokens=new_tokens,
            do_sample=False,
            pad_token_id=pad,
        )
        wall = time.perf_counter() - t0
        assert out.shape[1] - width == new_tokens
        return wall, out[:, width:]

    # -- figures ------------------------------------------------------------------------------

    def warm_up(self) -> None:
        self.hf_generate(self.prompts[:1], 8)
        self.hf_generate(self.prompts, 8)
        self.engine_tps(self.prompts)  # c8, full length: warms every decode batch size up to 8
        self.engine_run(self.prompts + self.prompts, lambda i: greedy_params(max_tokens=8))

    def sequential_and_c1(self) -> dict:
        hf_rates, eng_rates, ratios, agree = [], [], [], []
        for p in self.prompts:
            wall, hf_out = self.hf_generate([p])
            hf_rate = NEW_TOKENS / wall
            w, tokens, cols = self.engine_run([p], lambda i: greedy_params())
            eng_rate = tokens / w
            hf_rates.append(hf_rate)
            eng_rates.append(eng_rate)
            ratios.append(eng_rate / hf_rate)
            # sanity: the engine's greedy text starts with HF's first 16 greedy tokens
            ref_text = self.tok.decode(hf_out[0, :16].tolist(), skip_special_tokens=True)
            agree.append("".join(o.text for o in cols[0].outputs).startswith(ref_text))
        return {
            "hf_sequential_tps": statistics.median(hf_rates),
            "hf_sequential_tps_all": hf_rates,
            "engine_c1_tps": statistics.median(eng_rates),
            "engine_c1_tps_all": eng_rates,
            "engine_speedup_c1": statistics.median(ratios),
            "greedy_first16_match_hf": f"{sum(agree)}/{len(agree)}",
        }

    def static_batch(self) -> float:
        walls = [self.hf_generate(self.prompts)[0] for _ in range(self.reps)]
        return NEW_TOKENS * len(self.prompts) / statistics.median(walls)

    def concurrency(self, c: int) -> float:
        prompts = (self.prompts * 2)[:c]
        return statistics.median(self.engine_tps(prompts) for _ in range(self.reps))

    def late_ttft(self) -> float:
        samples = []
        for _ in range(self.reps):
            early = [self.submit(p, greedy_params()) for p in self.prompts[:6]]
            for c in early:  # wait until all six are decoding
                c.first = None
                out = c.q.get(timeout=300)
                c.outputs.append(out)
            time.sleep(0.2)  # a few decode steps in
            late = self.submit(self.prompts[6], greedy_params())
            late.wait()
            samples.append(late.first - late.submitted)
            for c in early:
                c.wait()
        return statistics.median(samples)

    def row_ratios(self, rows: dict, reps: int = 5) -> dict:
        """c8 tok/s of each kind of row (all 8 requests alike) over plain greedy c8. Each ratio is the median of
        `reps` paired runs, plain and that kind back to back (in alternating order): this box's speed drifts by
        10-15 % within minutes, which unpaired medians of 3 carried into the ratios (0.89 and 0.96 for the same
        code, twenty minutes apart)."""
        plain: list[float] = []
        kinds: dict[str, list[float]] = {name: [] for name in rows}
        ratios: dict[str, list[float]] = {name: [] for name in rows}
        for rep in range(reps):
            for name, make_params in rows.items():
                pair = [("plain", lambda i: greedy_params()), (name, make_params)]
                tps = {kind: self.engine_tps(self.prompts, mp) for kind, mp in pair[:: -1 if rep % 2 else 1]}
                plain.append(tps["plain"])
                kinds[name].append(tps[name])
                ratios[name].append(tps[name] / tps["plain"])
        return {"plain_c8_tps": statistics.median(plain), **{f"{n}_c8_tps": statistics.median(kinds[n]) for n in rows},
                **{f"{n}_ratio_c8": statistics.median(ratios[n]) for n in rows}}

    def n4_ratio(self) -> tuple[float, float, float]:
        prompt = self.prompts[0]
        n4, sep = [], []
        for _ in range(self.reps):
            wall, tokens, _cols = self.engine_run([prompt], lambda i: greedy_params(n=4))
            assert tokens == 4 * NEW_TOKENS, tokens
            n4.append(wall)
            wall, tokens, _ = self.engine_run([prompt] * 4, lambda i: greedy_params())
            sep.append(wall)
        a, b = statistics.median(n4), statistics.median(sep)
        return a / b, a, b


def profile_decode_step(bench: Bench, batch: int, steps: int = 20) -> dict:
    """Time one decode step of the engine's forward at `batch` rows, split into forward and sampler."""
    eng = bench.engine
    eng.stop()  # the loop must not touch the cache while we drive the forward directly
    fwd, sampler = eng.runner, eng.sampler
    fwd.cache.give_slots_blocks(batch, fwd.cache.max_len)  # the scheduler's tables are not in use now
    for slot in range(batch):
        fwd.prefill(slot, bench.prompts[slot % len(bench.prompts)], 0)
    positions = [len(bench.prompts[s % len(bench.prompts)]) for s in range(batch)]
    tokens = [28] * batch

    class Row:
        def __init__(self, params):
            self.params, self.generator = params, torch.Generator().manual_seed(0)
            self.output_ids, self.prompt_ids = [], bench.prompts[0]

        def prompt_mask(self, vocab, device="cpu"):
            return torch.zeros(vocab, dtype=torch.bool, device=device)

    rows_plain = [Row(greedy_params()) for _ in range(batch)]
    rows_feat = [Row(features_params(i)) for i in range(batch)]
    fwd_t, smp_t, feat_t = [], [], []
    for step in range(steps):
        pos = [p + step for p in positions]
        t0 = time.perf_counter()
        logits = fwd.decode(tokens, pos)
        t1 = time.perf_counter()
        sampler.sample(logits.clone(), rows_plain)
        t2 = time.perf_counter()
        sampler.sample(logits.clone(), rows_feat)
        t3 = time.perf_counter()
        fwd_t.append(t1 - t0)
        smp_t.append(t2 - t1)
        feat_t.append(t3 - t2)
    return {
        "batch": batch,
        "forward_ms": 1000 * statistics.median(fwd_t),
        "sampler_greedy_ms": 1000 * statistics.median(smp_t),
        "sampler_features_ms": 1000 * statistics.median(feat_t),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--reps", type=int, default=3, help="repetitions per figure (median reported)")
    parser.add_argument("--no-profile", action="store_true", help="skip the per-step forward/sampler split")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"],
                        help="the engine's (and HF's) dtype; results go to engine.json, or engine_bf16.json")
    args = parser.parse_args()

    started = time.perf_counter()
    b = Bench(args.reps, args.dtype)
    lens = [len(p) for p in b.prompts]
    print(f"model: {MODEL_DIR.name} {args.dtype} (linears: {b.engine.runner.decoder.linear_kind}), torch threads "
          f"{torch.get_num_threads()}, load {b.load_s:.1f} s")
    print(f"prompt_tokens: {lens} (mean {statistics.mean(lens):.1f}), new tokens {NEW_TOKENS}, reps {args.reps}")
    b.warm_up()

    r: dict = {}
    timing = b.engine.core.timing
    timing.reset()
    r.update(b.sequential_and_c1())
    r["hf_static_c8_tps"] = b.static_batch()
    r["engine_c8_tps"] = b.concurrency(8)
    r["engine_c16_tps"] = b.concurrency(16)
    # the greedy c1/c8/c16 runs' pure decode steps, before the feature rows run more steps at 8
    r["step_breakdown_ms"] = {b_: v for b_, v in timing.summary().items() if b_ in (1, 8, 16)}
    r["late_ttft_s"] = b.late_ttft()
    rows = {"features": features_params}
    if _engine_supports_grammar():
        rows["grammar"] = lambda i: greedy_params(grammar=GRAMMAR)
    if b.lora:
        rows["lora"] = lambda i: greedy_params(lora_adapter="pirate")
    r.update(b.row_ratios(rows))
    r["grammar_row_ratio"] = r.get("grammar_ratio_c8")
    r["lora_row_ratio"] = r.get("lora_ratio_c8")
    r["n4_ratio"], r["n4_wall_s"], r["separate4_wall_s"] = b.n4_ratio()
    r["engine_speedup_c8"] = r["engine_c8_tps"] / r["hf_sequential_tps"]
    r["engine_speedup_c16"] = r["engine_c16_tps"] / r["hf_sequential_tps"]
    r["static_batch_ratio_c8"] = r["engine_c8_tps"] / r["hf_static_c8_tps"]
    r["hf_static_c8_speedup"] = r["hf_static_c8_tps"] / r["hf_sequential_tps"]

    if not args.no_profile:
        r["decode_step_profile"] = [profile_decode_step(b, n) for n in (1, 8, 16)]
    else:
        b.engine.stop()

    r["total_s"] = time.perf_counter() - started
    r["machine"] = {"cpu_count": os.cpu_count(), "platform": platform.platform(), "torch": torch.__version__}
    r["prompt_tokens"] = lens

    print(f"hf_sequential_tps: {r['hf_sequential_tps']:.2f}")
    print(f"hf_static_c8_tps: {r['hf_static_c8_tps']:.2f}  (x{r['hf_static_c8_speedup']:.2f} sequential)")
    print(f"engine_c1_tps: {r['engine_c1_tps']:.2f}")
    print(f"engine_c8_tps: {r['engine_c8_tps']:.2f}")
    print(f"engine_c16_tps: {r['engine_c16_tps']:.2f}")
    print(f"greedy_first16_match_hf: {r['greedy_first16_match_hf']} prompts")
    print(f"plain_c8_tps (ratio rows): {r['plain_c8_tps']:.2f}, all sampler features {r['features_c8_tps']:.2f}")
    print(f"n4_wall_s: {r['n4_wall_s']:.2f} vs 4 separate {r['separate4_wall_s']:.2f}")
    for batch, ms in r["step_breakdown_ms"].items():
        parts = " | ".join(f"{phase} {ms[phase]:.2f}" for phase in PHASES)
        print(f"step_b{batch}_ms: wall {ms['wall']:.1f} = {parts} | outside forward {100 * ms['outside_forward']:.0f}%")
    for prof in r.get("decode_step_profile", []):
        print(
            f"decode_step_b{prof['batch']}_ms: forward {prof['forward_ms']:.1f}, sampler greedy "
            f"{prof['sampler_greedy_ms']:.2f}, sampler all features {prof['sampler_features_ms']:.2f}"
        )
    for key in ("grammar_row_ratio", "lora_row_ratio"):
        print(f"{key}: {'n/a' if r[key] is None else format(r[key], '.2f')}")
    print(f"total_s: {r['total_s']:.0f}")
    print(f"engine_speedup_c1: {r['engine_speedup_c1']:.2f}")
    print(f"engine_speedup_c8: {r['engine_speedup_c8']:.2f}")
    print(f"engine_speedup_c16: {r['engine_speedup_c16']:.2f}")
    print(f"static_batch_ratio_c8: {r['static_batch_ratio_c8']:.2f}")
    print(f"late_ttft_s: {r['late_ttft_s']:.3f}")
    print(f"features_ratio_c8: {r['features_ratio_c8']:.2f}")
    print(f"n4_ratio: {r['n4_ratio']:.2f}")
    results = RESULTS if args.dtype == "float32" else RESULTS.with_name("engine_bf16.json")
    results.parent.mkdir(parents=True, exist_ok=True)
    results.write_text(json.dumps(r, indent=2))


def _engine_supports_grammar() -> bool:
    """True once the engine compiles SamplingParams.grammar into a per-sequence matcher."""
    return hasattr(LLMEngine, "grammar_factory")


if __name__ == "__main__":
    main()
