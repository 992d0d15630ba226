"""GPU benchmark: the engine against HF on the same random bf16 weights, in one run, on one device.

No downloads: each model is built from its config with random bf16 weights straight on the device (the SmolLM2
tokenizer, carried, makes the prompts and decodes the text). Models:
  smollm2-135m    SmolLM2-135M's own shape (30 layers, hidden 576, GQA 9/3).
  qwen3-4b-body   Qwen3-4B's body (36 layers, hidden 2560, GQA 32/8, head_dim 128) with SmolLM2's vocab (3.76 B).
Workload: about 36-token chat prompts (SmolLM2's template, each prompt distinct), 128 new tokens, EOS ignored.

Figures per model (tok/s = generated tokens over wall time from submission to the last token):
  hf_c1            HF `generate`, one prompt at a time (median over prompts).
  engine_c1        the engine, one request at a time (median over the same prompts).
  hf_static_c64    HF `generate` of 64 prompts as one left-padded batch.
  hf_cb_c64        transformers' continuous batching (`generate_batch`) of the same 64 prompts.
  engine_c64       the engine, 64 requests submitted at once; outputs drained as they arrive (one queue fed by
                   every request, so no request waits behind another's reader and TTFT means time to first token).
  engine_features_c64  the same with every sampler feature on (penalties, logit_bias, top_k/top_p, seeds,
                   logprobs with top_logprobs); features_ratio = that over engine_c64.
  step_b1_ms       the engine's time per output token of a lone request (decode step + sampling + outputs).
  levers           forward-only decode step times: eager vs CUDA graph, and eager with a full host thread pool
                   after host-side tensor work (the suspect for "every launch 5x slower inside the engine").
The summary lines printed last are for the 4B body (the last model with --tiny); roofline_frac is tok/s over
(4.8 TB/s / weight bytes read per token). The 4B body runs first, so a run cut short still has its figures.

Run on the device: bench/gpu_device_run.sh (carried wheels + tokenizer). Dry run on CPU with tiny configs:
`.venv/bin/python -m bench.gpu --tiny` (about a minute).
"""

from __future__ import annotations

import argparse
import gc
import inspect
import json
import os
import queue
import statistics
import sys
import time
import traceback
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
DEFAULT_TOKENIZER = Path(os.environ.get("SIE_MODEL_CACHE") or REPO / ".cache" / "models") / "SmolLM2-135M-Instruct"
HBM_BYTES_PER_S = 4.8e12  # H200

USER_TURNS = [
    "Why is the sky blue?", "Write a haiku about rain.", "Name three primary colors.", "How do bees make honey?",
    "What is a black hole?", "Give me a pasta recipe.", "Explain gravity to a child.", "Describe a sunny beach.",
]

SMOLLM2 = dict(model_type="llama", vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
               num_attention_heads=9, num_key_value_heads=3, head_dim=64, max_position_embeddings=8192,
               rms_norm_eps=1e-5, rope_theta=100000.0, tie_word_embeddings=True)
QWEN3_4B_BODY = dict(model_type="qwen3", vocab_size=49152, hidden_size=2560, intermediate_size=9728,
                     num_hidden_layers=36, num_attention_heads=32, num_key_value_heads=8, head_dim=128,
                     max_position_embeddings=40960, rms_norm_eps=1e-6, rope_theta=1000000.0,
                     tie_word_embeddings=True)
# the 4B body first: its figures are the GPU goal (docs/gpu.md) and must survive a run cut short
MODELS = {"qwen3-4b-body": QWEN3_4B_BODY, "smollm2-135m": SMOLLM2}
SUMMARY_MODEL = "qwen3-4b-body"
TINY = {
    "tiny-llama": {**SMOLLM2, "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
                   "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16},
    "tiny-qwen3": {**QWEN3_4B_BODY, "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
                   "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16},
}


def log(msg: str) -> None:
    print(msg, flush=True)


def build_model(spec: dict, device: str, dtype: torch.dtype) -> torch.nn.Module:
    """Random weights made on `device` itself (no host copy, no download)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    spec = dict(spec)
    model_type = spec.pop("model_type")
    theta = spec.pop("rope_theta")
    config = AutoConfig.for_model(model_type, **spec, rope_parameters={"rope_type": "default", "rope_theta": theta},
                                  bos_token_id=1, eos_token_id=2, pad_token_id=2)
    config.architectures = [{"llama": "LlamaForCausalLM", "qwen3": "Qwen3ForCausalLM"}[model_type]]
    torch.manual_seed(0)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype, attn_implementation="sdpa")
    return model.eval()


def weight_bytes(model: torch.nn.Module) -> int:
    """Bytes of weights read per decoded token (tied embeddings counted once: the LM head reads them)."""
    seen, total = set(), 0
    for p in model.parameters():
        if p.data_ptr() not in seen:
            seen.add(p.data_ptr())
            total += p.numel() * p.element_size()
    return total


def sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


class Bench:
    def __init__(self, name: str, spec: dict, args) -> None:
        from transformers import AutoTokenizer

        from engine.llm_engine import EngineConfig, LLMEngine

        self.name, self.args, self.device = name, args, args.device
        self.new = args.new_tokens
        t0 = time.perf_counter()
        self.tok = AutoTokenizer.from_pretrained(args.tokenizer)
        self.model = build_model(spec, self.device, self.dtype)
        self.weight_bytes = weight_bytes(self.model)
        self.params = sum(p.numel() for p in {p.data_ptr(): p for p in self.model.parameters()}.values())
        built = time.perf_counter() - t0
        fields = EngineConfig.__dataclass_fields__
        extra = {"prefix_cache_tokens": 0} if "prefix_cache_tokens" in fields else {}  # HF has none: same work
        if "cuda_graphs" in fields:
            extra["cuda_graphs"] = not args.no_graphs
        config = EngineConfig(str(args.tokenizer), max_slots=args.concurrency, max_len=args.max_len,
                              max_num_batched_tokens=512 + args.concurrency, device=self.device,
                              dtype=str(self.dtype).removeprefix("torch."),
                              **extra)
        self.engine = LLMEngine(config, loaded=(self.model, self.tok, None))
        self.engine.start()
        log(f"[{name}] {self.params / 1e9:.3f} B params, {self.weight_bytes / 1e9:.2f} GB of weights; built in "
            f"{built:.1f} s, engine ready in {time.perf_counter() - t0 - built:.1f} s")
        self.prompts = [self.engine.encode_prompt(messages=[{"role": "user", "content": f"{USER_TURNS[i % 8]} ({i})"}])
                        for i in range(args.concurrency)]
        self._rid = 0

    @property
    def dtype(self) -> torch.dtype:
        return getattr(torch, self.args.dtype)

    # -- engine ---------------------------------------------------------------------------------

    def engine_run(self, prompts: list[list[int]], make_params) -> dict:
        """Submit all at once; drain every request's outputs from one queue as they arrive."""
        from engine.request import EngineRequest

        arrivals: queue.SimpleQueue = queue.SimpleQueue()
        t0 = time.perf_counter()
        rids = []
        for i, p in enumerate(prompts):
            self._rid += 1
            rid = f"r{self._rid}"
            rids.append(rid)
            params = make_params(i)
            request = EngineRequest(rid, p, params, lambda out, rid=rid: arrivals.put((rid, out)), stream=True)
            request.grammar = self.engine.grammar_factory(params)
            self.engine.submit(request)
        first: dict[str, float] = {}
        done: dict[str, float] = {}
        tokens = 0
        while len(done) < len(rids):
            rid, out = arrivals.get(timeout=600)
            now = time.perf_counter()
            if out.error is not None:
                raise RuntimeError(f"{rid} failed: {out.error.code}: {out.error.message}")
            first.setdefault(rid, now)
            if out.finish_reason is not None:
                tokens += out.completion_tokens
            if out.final:
                done[rid] = now
        wall = max(done.values()) - t0
        per_token = [(done[r] - first[r]) / max(self.new - 1, 1) for r in rids]
        return {"wall_s": wall, "tokens": tokens, "tps": tokens / wall,
                "ttft_p50_s": statistics.median(first[r] - t0 for r in rids),
                "tpot_p50_ms": 1000 * statistics.median(per_token)}

    def greedy(self, max_tokens: int | None = None):
        from engine.sampling_params import SamplingParams

        return SamplingParams(temperature=0.0, max_tokens=max_tokens or self.new, ignore_eos=True)

    def features(self, i: int, max_tokens: int | None = None):
        from engine.sampling_params import SamplingParams

        return SamplingParams(ignore_eos=True, max_tokens=max_tokens or self.new, temperature=0.7, top_k=50, top_p=0.95,
                              seed=1234 + i, logprobs=True, top_logprobs=5,
                              logit_bias={28: -100.0, 30: 2.0, 1075: -5.0}, presence_penalty=0.5,
                              frequency_penalty=0.3, repetition_penalty=1.1)

    # -- HF -------------------------------------------------------------------------------------

    @torch.inference_mode()
    def hf_generate(self, batch: list[list[int]], new_tokens: int) -> float:
        width = max(len(p) for p in batch)
        pad = self.tok.pad_token_id if self.tok.pad_token_id is not None else 2
        ids = torch.tensor([[pad] * (width - len(p)) + p for p in batch], device=self.device)  # left padding
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in batch], device=self.device)
        sync(self.device)
        t0 = time.perf_counter()
        out = self.model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=new_tokens,
                                  min_new_tokens=new_tokens, do_sample=False, pad_token_id=pad)
        sync(self.device)
        wall = time.perf_counter() - t0
        assert out.shape[1] - width == new_tokens, out.shape
        return wall

    def hf_continuous_batching(self, prompts: list[list[int]], new_tokens: int) -> dict:
        from transformers import GenerationConfig

        config = GenerationConfig(max_new_tokens=new_tokens, do_sample=False, eos_token_id=-1, pad_token_id=2)
        # its keyword arguments change between transformers releases (the device has 5.17)
        accepted = inspect.signature(self.model.generate_batch).parameters
        extra = {"progress_bar": False} if "progress_bar" in accepted else {}
        sync(self.device)
        t0 = time.perf_counter()
        results = self.model.generate_batch(inputs=prompts, generation_config=config, **extra)
        sync(self.device)
        wall = time.perf_counter() - t0
        tokens = sum(len(r.generated_tokens) for r in results.values())
        return {"wall_s": wall, "tokens": tokens, "tps": tokens / wall}

    # -- figures --------------------------------------------------------------------------------

    def run(self) -> dict:
        c, n, out = self.args.concurrency, self.new, {"model": self.name, "params_b": self.params / 1e9}
        c1_prompts = self.prompts[: self.args.c1_prompts]
        roofline = HBM_BYTES_PER_S / self.weight_bytes
        out["roofline_tps"] = roofline
        # warm-up: every prefill/decode shape the figures use, full length (CUDA graphs are captured per batch
        # and span bucket here, not in the timed runs)
        t0 = time.perf_counter()
        self.engine_run(c1_prompts[:1], lambda i: self.greedy())
        self.engine_run(self.prompts, lambda i: self.greedy())
        self.engine_run(self.prompts, lambda i: self.features(i, 8))
        self.hf_generate(c1_prompts[:1], 4)
        self.hf_generate(self.prompts, 4)
        log(f"[{self.name}] warm-up {time.perf_counter() - t0:.1f} s")

        hf_c1 = [n / self.hf_generate([p], n) for p in c1_prompts]
        out["hf_c1_tps"] = statistics.median(hf_c1)
        c1 = [self.engine_run([p], lambda i: self.greedy()) for p in c1_prompts]
        out["engine_c1_tps"] = statistics.median(r["tps"] for r in c1)
        out["step_b1_ms"] = statistics.median(r["tpot_p50_ms"] for r in c1)
        out["roofline_frac_c1"] = out["engine_c1_tps"] / roofline
        log(f"[{self.name}] c1: HF generate {out['hf_c1_tps']:.1f} tok/s, engine {out['engine_c1_tps']:.1f} tok/s "
            f"({out['roofline_frac_c1']:.3f} of the {roofline:.0f} tok/s roofline), step {out['step_b1_ms']:.2f} ms")

        plain = self.engine_run(self.prompts, lambda i: self.greedy())
        feats = self.engine_run(self.prompts, self.features)
        out["engine_c64"] = plain
        out["engine_features_c64"] = feats
        out["features_ratio_c64"] = feats["tps"] / plain["tps"]
        log(f"[{self.name}] engine c{c}: {plain['tps']:.0f} tok/s, TTFT p50 {plain['ttft_p50_s']:.3f} s, "
            f"TPOT p50 {plain['tpot_p50_ms']:.2f} ms; all features {feats['tps']:.0f} tok/s "
            f"(ratio {out['features_ratio_c64']:.3f})")

        out["hf_static_c64_tps"] = c * n / self.hf_generate(self.prompts, n)
        log(f"[{self.name}] HF static batch c{c}: {out['hf_static_c64_tps']:.0f} tok/s")
        try:
            self.hf_continuous_batching(self.prompts[:2], 4)  # its own warm-up (cache, graphs)
            cb = self.hf_continuous_batching(self.prompts, n)
            out["hf_cb_c64"] = cb
            out["c64_vs_hf_cb"] = plain["tps"] / cb["tps"]
            log(f"[{self.name}] transformers generate_batch c{c}: {cb['tps']:.0f} tok/s "
                f"({cb['tokens']} tokens); engine / it = {out['c64_vs_hf_cb']:.2f}")
        except Exception as exc:  # a baseline that fails must not hide the engine's figures
            traceback.print_exc()
            out["hf_cb_error"] = f"{type(exc).__name__}: {exc}"
            out["c64_vs_hf_cb"] = float("nan")
        self.engine.stop()
        try:
            out["levers"] = self.levers()
        except Exception as exc:  # diagnostics only: never lose the figures above
            traceback.print_exc()
            out["levers"] = {"error": f"{type(exc).__name__}: {exc}"}
        return out

    def levers(self) -> dict:
        """Forward-only decode steps, driven directly (the engine loop is stopped): what each lever buys."""
        fwd = self.engine.runner  # graphs toggled on the one runner: a second one would need a second KV cache
        graphs = getattr(fwd, "graphs", None)
        res: dict = {}
        rows = self.args.concurrency  # each row its own blocks: the scheduler's tables are not in use now
        fwd.cache.give_slots_blocks(rows, max(len(self.prompts[i]) for i in range(rows)) + 1)
        for b in sorted({1, self.args.concurrency}):
            tokens, positions = [28] * b, [len(self.prompts[i]) for i in range(b)]
            fwd.graphs = None
            res[f"eager_b{b}_ms"] = self._time_decode(fwd, tokens, positions)
            if graphs is not None:
                fwd.graphs = graphs
                res[f"graph_b{b}_ms"] = self._time_decode(fwd, tokens, positions)
            # the suspect: a full intra-op pool woken by host-side tensor work, then GPU launches
            fwd.graphs = None
            threads = torch.get_num_threads()
            torch.set_num_threads(os.cpu_count() or 1)
            torch.randn(256, 49152, device="cpu").softmax(-1)
            res[f"eager_b{b}_after_host_work_all_threads_ms"] = self._time_decode(fwd, tokens, positions)
            torch.set_num_threads(threads)
            fwd.graphs = graphs
        if self.device.startswith("cuda"):
            res["kernels_per_eager_step_b1"] = self._count_kernels(fwd, [28], [len(self.prompts[0])])
        log(f"[{self.name}] levers: " + ", ".join(f"{k} {v:.2f}" if isinstance(v, float) else f"{k} {v}"
                                                  for k, v in res.items()))
        return res

    def _time_decode(self, fwd, tokens, positions, steps: int = 20) -> float:
        times = []
        for _ in range(steps + 3):
            sync(self.device)
            t0 = time.perf_counter()
            fwd.decode(tokens, positions)
            sync(self.device)
            times.append(time.perf_counter() - t0)
        return 1000 * statistics.median(times[3:])

    def _count_kernels(self, fwd, tokens, positions) -> int:
        from torch.profiler import ProfilerActivity, profile

        graphs, fwd.graphs = getattr(fwd, "graphs", None), None
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            fwd.decode(tokens, positions)
            sync(self.device)
        fwd.graphs = graphs
        return sum(1 for e in prof.events() if str(e.device_type).endswith("CUDA"))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tiny", action="store_true", help="tiny configs on the CPU: a dry run of the script")
    parser.add_argument("--device", default=None, help="default: cuda (cpu with --tiny)")
    parser.add_argument("--dtype", default=None, help="default: bfloat16 (float32 with --tiny)")
    parser.add_argument("--models", default=None, help="comma-separated subset of the models, in order")
    parser.add_argument("--tokenizer", default=str(DEFAULT_TOKENIZER), help="folder with the SmolLM2 tokenizer")
    parser.add_argument("--new-tokens", type=int, default=None, help="default: 128 (16 with --tiny)")
    parser.add_argument("--concurrency", type=int, default=None, help="default: 64 (8 with --tiny)")
    parser.add_argument("--c1-prompts", type=int, default=2)
    parser.add_argument("--max-len", type=int, default=512)
    parser.add_argument("--no-graphs", action="store_true", help="engine without CUDA graphs")
    parser.add_argument("--out", default=str(REPO / "bench" / "results" / "gpu.json"))
    args = parser.parse_args()
    args.device = args.device or ("cpu" if args.tiny else "cuda")
    args.dtype = args.dtype or ("float32" if args.tiny else "bfloat16")
    args.new_tokens = args.new_tokens or (16 if args.tiny else 128)
    args.concurrency = args.concurrency or (8 if args.tiny else 64)
    specs = TINY if args.tiny else MODELS
    names = args.models.split(",") if args.models else list(specs)
    if args.device.startswith("cuda") and not torch.cuda.is_available():
        sys.exit("no CUDA device (use --tiny for the CPU dry run)")
    env = {"torch": torch.__version__, "device": args.device,
           "gpu": torch.cuda.get_device_name() if args.device.startswith("cuda") else None}
    log(f"bench.gpu: {env}")
    results = []
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    for name in names:
        try:
            bench = Bench(name, specs[name], args)
            results.append(bench.run())
        except Exception as exc:  # one model failing must not lose the other's figures
            traceback.print_exc()
            results.append({"model": name, "error": f"{type(exc).__name__}: {exc}"})
        bench = None
        gc.collect()
        if args.device.startswith("cuda"):
            torch.cuda.empty_cache()
        # after every model, so a run cut short keeps what it measured
        Path(args.out).write_text(json.dumps({"env": env, "args": vars(args), "results": results}, indent=2))
    r = next((x for x in results if x["model"] == SUMMARY_MODEL), results[-1])
    nan = float("nan")
    c64 = r.get("engine_c64", {})
    log(f"(summary lines: {r['model']}{'; FAILED: ' + r['error'] if 'error' in r else ''})")
    log(f"gpu_c1_tps: {r.get('engine_c1_tps', nan):.2f}")
    log(f"gpu_c1_roofline_frac: {r.get('roofline_frac_c1', nan):.4f}")
    log(f"gpu_c64_tps: {c64.get('tps', nan):.2f}")
    log(f"gpu_c64_vs_hf_cb: {r.get('c64_vs_hf_cb', nan):.3f}")
    log(f"gpu_c64_ttft_p50_s: {c64.get('ttft_p50_s', nan):.4f}")
    log(f"gpu_features_ratio_c64: {r.get('features_ratio_c64', nan):.3f}")
    log(f"gpu_step_b1_ms: {r.get('step_b1_ms', nan):.3f}")


if __name__ == "__main__":
    main()
