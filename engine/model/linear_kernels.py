"""The linear (GEMM) path of the CPU forward, chosen at load by the instruction set and a quick measurement.

Why: the torch wheel's MKL picks its kernels by CPU vendor, and on AMD it takes an AVX2 path for the small-row
GEMMs of batched decode, even on AVX-512 parts (shared/notes/cpu-decode.md). oneDNN (bundled with torch) picks its
kernels by ISA (brgemm with avx512_core / avx512_core_bf16 / AMX where present) and, with weights prepacked into
its blocked layout once at load (as inductor's `mkldnn._linear_pointwise` does), runs those GEMMs much faster there.
Which one wins depends on the CPU, so the forward asks `choose_kind` once: the ISA sets the default (oneDNN on
AVX-512, F.linear otherwise) and a quick timing of both on the model's own weight shapes overturns it on a clear
loss. `SIE_LINEAR_KERNEL=mkl|dnnl` overrides the choice.

Kinds: "torch" (plain F.linear; GPU and CPUs without oneDNN), "mkl" (F.linear on CPU), "dnnl" (prepacked oneDNN).
A prepacked weight is an mkldnn-layout tensor; `linear` dispatches on that, so call sites stay one line.
"""

from __future__ import annotations

import functools
import logging
import os
import time

import torch
import torch.nn.functional as F

log = logging.getLogger(__name__)

KINDS = ("torch", "mkl", "dnnl")
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


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    if weight.is_mkldnn:
        if x.dim() != 2:  # the packed op takes [N, K]
            return linear(x.reshape(-1, x.shape[-1]), weight, bias).view(*x.shape[:-1], -1)
        return torch.ops.mkldnn._linear_pointwise(x, weight, bias, "none", [], "")
    return F.linear(x, weight, bias)


def pack(weight: torch.Tensor, kind: str) -> torch.Tensor:
    """The weight in the layout `kind` wants: prepacked for "dnnl", dense otherwise (a packed one unpacked)."""
    if kind == "dnnl":
        return weight if weight.is_mkldnn else torch.ops.mkldnn._reorder_linear_weight(weight, _PACK_BATCH_HINT)
    return weight.to_dense() if weight.is_mkldnn else weight


def _time(fn, reps: int) -> float:
    t0 = time.perf_counter()
    for _ in range(reps):
        fn()
    return time.perf_counter() - t0


@torch.inference_mode()
def measure(weights: list[torch.Tensor], rows: tuple[int, ...] = (1, 8), rounds: int = 5) -> dict[str, float]:
    """Seconds for one pass of `weights` as linears at each of `rows`, through MKL and through packed oneDNN.

    The two paths alternate and each keeps its best round: on a box other jobs load, a descheduled OpenMP thread
    stalls whichever path happens to run, so only the best rounds compare the kernels."""
    packed = [pack(w, "dnnl") for w in weights]
    inputs = [[torch.randn(m, w.shape[1], dtype=w.dtype) for w in weights] for m in rows]

    def run_mkl() -> None:
        for x in inputs:
            for a, w in zip(x, weights, strict=True):
                F.linear(a, w)

    def run_dnnl() -> None:
        for x in inputs:
            for a, w in zip(x, packed, strict=True):
                linear(a, w)

    run_mkl()  # first-call costs (oneDNN primitive creation) are not the kernels'
    run_dnnl()
    best = {"mkl": float("inf"), "dnnl": float("inf")}
    for _ in range(rounds):
        best["mkl"] = min(best["mkl"], _time(run_mkl, 3))
        best["dnnl"] = min(best["dnnl"], _time(run_dnnl, 3))
    return best


def choose_kind(device: torch.device, weights: list[torch.Tensor]) -> str:
    """The linear path for a forward on `device` whose per-layer weights are `weights` (one layer's worth)."""
    forced = os.environ.get("SIE_LINEAR_KERNEL", "auto").strip().lower()
    if device.type != "cpu":
        return "torch"
    if forced in ("mkl", "dnnl"):
        return forced if forced == "mkl" or torch.backends.mkldnn.is_available() else "mkl"
    if not torch.backends.mkldnn.is_available():
        return "mkl"
    try:
        times = measure(weights)
    except RuntimeError as exc:  # a oneDNN build without this op or dtype: stay on F.linear
        log.warning("oneDNN linear unavailable (%s); using F.linear", exc)
        return "mkl"
    # the ISA sets the default (oneDNN's brgemm kernels where AVX-512 is present); the measurement overturns it
    # only on a clear loss, so a noisy moment at load cannot flip a box to its slower path
    prior = "dnnl" if cpu_isa().startswith("AVX512") else "mkl"
    other = "mkl" if prior == "dnnl" else "dnnl"
    kind = other if times[other] < _WIN_FACTOR * times[prior] else prior
    log.info("linear kernel %s (ISA %s; one layer at 1+8 rows: mkl %.2f ms, dnnl %.2f ms)", kind, cpu_isa(),
             times["mkl"] * 1e3, times["dnnl"] * 1e3)
    return kind
