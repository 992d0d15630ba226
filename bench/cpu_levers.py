"""CPU decode levers, measured in process against the engine.runner ModelRunner over the real model.

Each variant prefills B rows (prompts of different lengths, so rows sit at different positions), then times greedy
decode steps; tok/s = B x steps / seconds, best of --reps repetitions. Variants:
  base       the engine as it is (its linear-op choice at load included)
  mkl        every linear through F.linear (MKL), the path before the prepacked oneDNN linears
  dnnl       every linear through oneDNN with weights prepacked (torch.ops.mkldnn._linear_pointwise)
  bf16       bf16 weights and KV cache, F.linear
  bf16_dnnl  bf16 weights prepacked for oneDNN
  fmask      the decode mask as a precomputed additive float mask instead of a bool one
  nomask     no mask at all (wrong unless all rows have one length; an upper bound for any mask/attention lever)
  compile    torch.compile(dynamic=False) of the decode step, span fixed to one bucket (static shapes)
Greedy tokens of every variant are compared with `mkl`'s (`same_tokens`: rows whose tokens all match).

    .venv/bin/python -m bench.cpu_levers --batches 1 8 16 --variants mkl dnnl bf16 bf16_dnnl
"""

from __future__ import annotations

import argparse
import contextlib
import time
from collections.abc import Iterator

import torch
import torch.nn.functional as F

import engine.model.decoder as forward_module
from devstack.triton import REPO_ROOT
from engine.model import linear_kernels
from engine.model.decoder import Decoder
from engine.model.loading import load_model
from engine.runner.model_runner import ModelRunner

MODEL_DIR = REPO_ROOT / ".cache" / "models" / "SmolLM2-135M-Instruct"
MAX_LEN = 512


def _prompts(b: int) -> list[list[int]]:
    # lengths 40..70: rows decode at different positions, as under continuous batching
    return [[(7 * r + 13 * i) % 4000 + 100 for i in range(40 + (r * 7) % 31)] for r in range(b)]


@contextlib.contextmanager
def _kernel(fwd: ModelRunner, kind: str) -> Iterator[None]:
    """Re-prepare fwd's linear weights for `kind` ('mkl' or 'dnnl'), restored afterwards."""
    saved = fwd.decoder.linear_kind
    fwd.decoder.set_linear_kind(kind)
    try:
        yield
    finally:
        fwd.decoder.set_linear_kind(saved)


@contextlib.contextmanager
def _mask_mode(mode: str) -> Iterator[None]:
    """Patch SDPA in engine.model.decoder: 'float' turns a bool mask into an additive one, 'none' drops it."""
    original = forward_module.F

    class _Shim:
        def __getattr__(self, name):
            return getattr(F, name)

        @staticmethod
        def scaled_dot_product_attention(q, k, v, attn_mask=None, **kw):
            if attn_mask is not None and attn_mask.dtype == torch.bool and q.shape[2] != k.shape[2]:
                if mode == "none":
                    attn_mask = None
                else:
                    cached = _Shim.cache.get(id(attn_mask))
                    if cached is None:
                        cached = torch.zeros(attn_mask.shape, dtype=q.dtype).masked_fill_(~attn_mask, float("-inf"))
                        _Shim.cache = {id(attn_mask): cached}
                    attn_mask = cached
            return F.scaled_dot_product_attention(q, k, v, attn_mask=attn_mask, **kw)

        cache: dict = {}

    forward_module.F = _Shim()  # type: ignore[assignment]
    try:
        yield
    finally:
        forward_module.F = original


def _decode_run(fwd: ModelRunner, b: int, steps: int, step_fn=None) -> tuple[float, list[list[int]]]:
    prompts = _prompts(b)
    logits = fwd.prefill_batch(list(range(b)), prompts, [None] * b)
    tokens = logits.argmax(-1).tolist()
    positions = [len(p) for p in prompts]
    out: list[list[int]] = [[t] for t in tokens]
    step = step_fn or fwd.decode  # the scheduler's call: python lists in, [B, V] logits out
    t0 = 0.0
    warm = 3
    for s in range(warm + steps):
        if s == warm:
            t0 = time.perf_counter()
        tokens = step(tokens, positions).argmax(-1).tolist()
        positions = [p + 1 for p in positions]
        for r in range(b):
            out[r].append(tokens[r])
    return b * steps / (time.perf_counter() - t0), out


def _best_run(fwd, b, steps, reps, **kw) -> tuple[float, list[list[int]]]:
    """Best of `reps`: on a shared 2-core box, neighbours only ever slow a run down."""
    runs = [_decode_run(fwd, b, steps, **kw) for _ in range(reps)]
    return max(r[0] for r in runs), runs[0][1]


def _static_decode(runner: ModelRunner, token_t: torch.Tensor, pos_t: torch.Tensor, span: int) -> torch.Tensor:
    """The decoder's decode with tensor inputs and a fixed span, so one graph serves every step of a bucket."""
    return runner.decoder.logits(runner.decoder.decode_hidden(runner.cache, token_t, pos_t, span))


def _compiled_step(fwd: ModelRunner, bucket: int):
    inner = torch.compile(_static_decode, dynamic=False)

    def step(tokens: list[int], positions: list[int]) -> torch.Tensor:
        with torch.inference_mode():
            return inner(fwd, torch.tensor(tokens), torch.tensor(positions), bucket)
    return step


def _prefill_ms(fwd: ModelRunner, n: int) -> float:
    ids = list(range(100, 100 + n))
    fwd.prefill(0, ids, 0)
    t0 = time.perf_counter()
    for _ in range(3):
        fwd.prefill(0, ids, 0)
    return (time.perf_counter() - t0) / 3 * 1000


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 8, 16])
    parser.add_argument("--variants", nargs="+", default=["base", "mkl", "dnnl", "bf16", "bf16_dnnl", "fmask",
                                                         "nomask"])
    parser.add_argument("--steps", type=int, default=32)
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--prefill", type=int, nargs="*", default=[512], help="also time a prefill of N tokens")
    parser.add_argument("--threads", type=int, default=None,
                        help="torch threads (1 gives stable relative figures on a box other jobs load: a spinning "
                             "OpenMP barrier waits on a descheduled thread)")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    print(f"torch {torch.__version__}, threads {torch.get_num_threads()}, ISA {linear_kernels.cpu_isa()}, "
          f"native bf16: {linear_kernels.native_bf16()}", flush=True)
    models: dict[torch.dtype, ModelRunner] = {}

    def fwd_for(dtype: torch.dtype) -> ModelRunner:
        if dtype not in models:
            model, _, _ = load_model(str(MODEL_DIR), dtype, "cpu")
            models[dtype] = ModelRunner(Decoder(model, MAX_LEN), 16, MAX_LEN)
        return models[dtype]

    reference: dict[int, list[list[int]]] = {}
    for b in args.batches:
        for variant in ["mkl", *[v for v in args.variants if v != "mkl"]]:
            if variant not in args.variants and b in reference:
                continue
            dtype = torch.bfloat16 if variant.startswith("bf16") else torch.float32
            fwd = fwd_for(dtype)
            kinds = {"mkl": "mkl", "dnnl": "dnnl", "bf16": "mkl", "bf16_dnnl": "dnnl"}
            kind = kinds.get(variant, fwd.decoder.linear_kind)
            step_fn = None
            mask = {"fmask": "float", "nomask": "none"}.get(variant)
            t_compile = 0.0
            if variant == "compile":
                step_fn = _compiled_step(fwd, MAX_LEN // 2)
                t0 = time.perf_counter()
                with _kernel(fwd, kind):
                    _decode_run(fwd, b, 2, step_fn=step_fn)
                t_compile = time.perf_counter() - t0
            with _kernel(fwd, kind), (_mask_mode(mask) if mask else contextlib.nullcontext()):
                tok_s, toks = _best_run(fwd, b, args.steps, args.reps, step_fn=step_fn)
            if variant == "mkl":
                reference[b] = toks
            same = sum(t == r for t, r in zip(toks, reference[b], strict=True))
            extra = f"  compile_s {t_compile:.0f}" if variant == "compile" else ""
            print(f"B={b:<3} {variant:<10} [{kind}] {tok_s:8.1f} tok/s  same_tokens {same}/{b}{extra}", flush=True)
    for n in args.prefill:
        for variant in ("mkl", "dnnl"):
            fwd = fwd_for(torch.float32)
            with _kernel(fwd, variant):
                print(f"prefill {n} tokens fp32 [{variant}]: {_prefill_ms(fwd, n):.0f} ms", flush=True)


if __name__ == "__main__":
    main()
