"""The linear (GEMM) path of the CPU forward, chosen at load from the instruction set and the weights' dtype.

Why: the torch wheel's MKL picks its kernels by CPU vendor, and on AMD it takes an AVX2 path for the small-row
GEMMs of batched decode, even on AVX-512 parts (docs/cpu-decode.md). oneDNN (bundled with torch) picks its
kernels by ISA (brgemm with avx512_core / avx512_core_bf16 / AMX where present) and, with weights prepacked into
its blocked layout once at load (as inductor's `mkldnn._linear_pointwise` does), runs those GEMMs much faster there.
Our own tiled kernel (engine.model.tiled_linear) beats both at decode's row counts, and its rows do not depend on
their batch. The forward asks `choose_kind` once, and the answer depends only on the CPU's features and the
weights' dtype, never on a timing at load: tiled where it runs, else oneDNN, on AVX-512; F.linear otherwise. So the
same box always takes the same path, and with it the same activation dtype, KV memory and batch invariance (in
bf16 the tiled kernel is what keeps activations and KV in fp32, engine.model.decoder). `SIE_LINEAR_KERNEL=
mkl|dnnl|tiled` forces a kind; `SIE_LINEAR_KERNEL=timed` lets a quick timing of each kind on the model's own weight
shapes overturn the ISA's choice on a clear loss, and logs what it chose and why (a box whose MKL or oneDNN build
is unusually fast or slow; the guarantees are then those of the kind it logs).

Kinds: "torch" (plain F.linear; GPU and CPUs without oneDNN), "mkl" (F.linear on CPU), "dnnl" (prepacked oneDNN),
"tiled" (column tiles, our kernel: fp32, and bf16 where the CPU has AVX512_BF16). A
laid-out weight is an mkldnn-layout tensor or a `TiledWeight`; `linear` dispatches on that, so call sites stay one
line.
"""

from __future__ import annotations

import functools
import logging
import os
import time

import torch
import torch.nn.functional as F

from engine.model import tiled_linear
from engine.model.tiled_linear import TiledWeight

log = logging.getLogger(__name__)

KINDS = ("torch", "mkl", "dnnl", "tiled")
Weight = torch.Tensor | TiledWeight  # what `pack` returns and `linear` takes
# decode batch size the packed layout is tuned for; oneDNN accepts any row count with it
_PACK_BATCH_HINT = 8
# the path the ISA suggests is kept unless the other one is faster by this factor
_WIN_FACTOR = 0.9


@functools.cache
def cpu_flags() -> frozenset[str]:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("flags"):
                    return frozenset(line.split(":", 1)[1].split())
    except OSError:
        pass
    return frozenset()


def cpu_isa() -> str:
    """torch's view of the vector ISA ("AVX512", "AVX2", "DEFAULT", ...)."""
    return torch.backends.cpu.get_cpu_capability()


def native_bf16() -> bool:
    """True when the CPU multiplies bf16 in hardware (AVX512_BF16 or AMX), so bf16 weights halve memory traffic
    without an emulation penalty (on AVX2-only parts bf16 GEMMs were 2-3x slower than fp32)."""
    flags = cpu_flags()
    return bool(flags & {"avx512_bf16", "amx_bf16"}) and torch.backends.mkldnn.is_available()


def linear(x: torch.Tensor, weight: Weight, bias: torch.Tensor | None = None) -> torch.Tensor:
    if isinstance(weight, TiledWeight):
        return tiled_linear.tiled_linear(x, weight, bias)
    if weight.is_mkldnn:
        if x.dim() != 2:  # the packed op takes [N, K]
            return linear(x.reshape(-1, x.shape[-1]), weight, bias).view(*x.shape[:-1], -1)
        return torch.ops.mkldnn._linear_pointwise(x, weight, bias, "none", [], "")
    return F.linear(x, weight, bias)


def dense(weight: Weight) -> torch.Tensor:
    """The plain [N, K] weight of any layout."""
    if isinstance(weight, TiledWeight):
        return weight.dense()
    return weight.to_dense() if weight.is_mkldnn else weight


def pack(weight: Weight, kind: str) -> Weight:
    """The weight in the layout `kind` wants: prepacked for "dnnl", tiles for "tiled", dense otherwise."""
    if kind == "dnnl":
        if isinstance(weight, torch.Tensor) and weight.is_mkldnn:
            return weight
        return torch.ops.mkldnn._reorder_linear_weight(dense(weight), _PACK_BATCH_HINT)
    if kind == "tiled":
        return weight if isinstance(weight, TiledWeight) else TiledWeight(dense(weight))
    return dense(weight)


def _kinds_here(dtype: torch.dtype) -> list[str]:
    """The CPU kinds that can run `dtype` weights on this box."""
    kinds = ["mkl"]
    if torch.backends.mkldnn.is_available():
        kinds.append("dnnl")
    if tiled_linear.runs(dtype):
        kinds.append("tiled")
    return kinds


def _time(fn, reps: int) -> float:
    t0 = time.perf_counter()
    for _ in range(reps):
        fn()
    return time.perf_counter() - t0


@torch.inference_mode()
def measure(weights: list[torch.Tensor], rows: tuple[int, ...] = (1, 8), rounds: int = 5,
            kinds: list[str] | None = None) -> dict[str, float]:
    """Seconds for one pass of `weights` as linears at each of `rows`, through each of `kinds` (default: every
    kind this box can run for their dtype).

    The paths alternate and each keeps its best round: on a box other jobs load, a descheduled OpenMP thread
    stalls whichever path happens to run, so only the best rounds compare the kernels."""
    kinds = kinds or _kinds_here(weights[0].dtype)
    laid_out = {kind: [pack(w, kind) for w in weights] for kind in kinds}
    inputs = [[torch.randn(m, w.shape[1], dtype=w.dtype) for w in weights] for m in rows]

    def runner(kind: str):
        def run() -> None:
            for x in inputs:
                for a, w in zip(x, laid_out[kind], strict=True):
                    linear(a, w)
        return run

    runs = {kind: runner(kind) for kind in kinds}
    for run in runs.values():
        run()  # first-call costs (oneDNN primitive creation) are not the kernels'
    best = dict.fromkeys(kinds, float("inf"))
    for _ in range(rounds):
        for kind, run in runs.items():
            best[kind] = min(best[kind], _time(run, 3))
    return best


def by_isa(kinds: list[str]) -> str:
    """The ISA's choice among the kinds that run here: our tiled kernel, else oneDNN's brgemm, where AVX-512 is
    present; F.linear otherwise (on AVX2, MKL's own AVX2 kernels are as good and need no packing)."""
    if cpu_isa().startswith("AVX512"):
        return "tiled" if "tiled" in kinds else "dnnl" if "dnnl" in kinds else "mkl"
    return "mkl"


def choose_kind(device: torch.device, weights: list[torch.Tensor]) -> str:
    """The linear path for a forward on `device` whose per-layer weights are `weights` (one layer's worth)."""
    forced = os.environ.get("SIE_LINEAR_KERNEL", "auto").strip().lower()
    if device.type != "cpu":
        return "torch"
    dtype = weights[0].dtype
    kinds = _kinds_here(dtype)
    if forced in KINDS[1:]:
        if forced not in kinds:
            log.warning("SIE_LINEAR_KERNEL=%s cannot run here (%s weights); using mkl", forced, dtype)
        return forced if forced in kinds else "mkl"
    kind = by_isa(kinds)
    if forced != "timed" or len(kinds) == 1:
        log.info("linear kernel %s (ISA %s, %s weights; runs here: %s)", kind, cpu_isa(), dtype, ", ".join(kinds))
        return kind
    try:
        times = measure(weights, kinds=kinds)
    except RuntimeError as exc:  # a oneDNN build without this op or dtype: stay on F.linear
        log.warning("oneDNN linear unavailable (%s); using F.linear", exc)
        return "mkl"
    # the measurement overturns the ISA's choice only on a clear loss, so a noisy moment at load cannot flip a box
    # to its slower path
    fastest = min(times, key=times.__getitem__)
    chosen = fastest if times[fastest] < _WIN_FACTOR * times[kind] else kind
    log.info("linear kernel %s, timed (ISA %s would take %s; one layer at 1+8 rows: %s)", chosen, cpu_isa(), kind,
             ", ".join(f"{k} {t * 1e3:.2f} ms" for k, t in times.items()))
    return chosen
