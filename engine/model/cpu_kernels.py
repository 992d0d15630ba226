"""Our C++ CPU ops (engine/model/kernels/), one extension `sie_kernels`: the tiled fp32 and bf16 linears
(engine.model.tiled_linear), causal attention for prefill and decode (engine.model.attention) and the fused layer
ops (engine.model.layer_ops).

The extension is compiled once per torch version and source (torch.utils.cpp_extension, about 40 s), cached under
`SIE_KERNEL_CACHE` (default ~/.cache/sie-kernels); `make install` and the Triton image build it ahead
(`python -m engine.model.cpu_kernels`). Where no compiler or no AVX2 is there, `available()` is False and the engine
keeps torch's own ops (MKL/oneDNN linears, SDPA).
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import logging
import os
import shutil
import sys
from pathlib import Path

import torch

log = logging.getLogger(__name__)

KERNELS = Path(__file__).with_name("kernels")
SOURCES = [KERNELS / "tiled_linear.cpp", KERNELS / "tiled_linear_bf16.cpp", KERNELS / "tiled_linear_int8.cpp",
           KERNELS / "tiled_linear_int4.cpp", KERNELS / "causal_attention.cpp", KERNELS / "attention_bf16.cpp",
           KERNELS / "layer_ops.cpp", KERNELS / "lora_add.cpp", KERNELS / "row_ops.cpp"]
HEADERS = sorted(KERNELS.glob("*.h"))  # part of the cache key, not compiled on their own

# -fopenmp: at::parallel_for is inline OpenMP, without it the ops run on one thread. -ffp-contract=off: a written
# mul and add stay two roundings (RoPE matches torch bit for bit), never fused into an FMA behind our back.
_CFLAGS = ["-O3", "-fopenmp", "-ffp-contract=off"]


def _build_dir() -> Path:
    digest = hashlib.sha256(b"".join(p.read_bytes() for p in SOURCES + HEADERS) + " ".join(_CFLAGS).encode())
    root = Path(os.environ.get("SIE_KERNEL_CACHE") or Path.home() / ".cache" / "sie-kernels")
    tag = f"torch{torch.__version__.replace('+', '_')}-py{sys.version_info.major}{sys.version_info.minor}"
    return root / f"{tag}-{digest.hexdigest()[:12]}"


def _put_ninja_on_path() -> None:
    """cpp_extension runs `ninja` from PATH; tritonserver's stubs may not have the venv's bin there."""
    if shutil.which("ninja"):
        return
    with contextlib.suppress(ImportError):
        import ninja  # the PyPI wheel (an `engine` dependency) carries the binary

        os.environ["PATH"] = f"{ninja.BIN_DIR}{os.pathsep}{os.environ.get('PATH', '')}"


@functools.cache
def available() -> bool:
    """Build (once) and load the ops; False where they cannot run here (no AVX2/FMA, no compiler, a failed build)."""
    if not supported_here():  # torch's AVX2 level includes FMA
        return False
    if hasattr(torch.ops.sie_kernels, "silu_mul"):
        return True
    try:
        from torch.utils.cpp_extension import load

        _put_ninja_on_path()
        build = _build_dir()
        build.mkdir(parents=True, exist_ok=True)
        load(name="sie_kernels", sources=[str(p) for p in SOURCES], extra_cflags=_CFLAGS,
             extra_ldflags=["-fopenmp"], build_directory=str(build), is_python_module=False, verbose=False)
    except Exception as exc:  # a box without a compiler or ninja: the engine keeps torch's own ops
        log.warning("our CPU kernels are unavailable (%s); using torch's MKL/oneDNN linears and SDPA", exc)
        return False
    return hasattr(torch.ops.sie_kernels, "silu_mul")


def supported_here() -> bool:
    """Whether this CPU can run the ops at all (AVX2 with FMA, or AVX-512): where it can, a failed build is a
    broken install, not a fallback."""
    return torch.backends.cpu.get_cpu_capability() in ("AVX2", "AVX512")


if __name__ == "__main__":  # `make install`: build the ops ahead, so the first model load does not wait for them
    logging.basicConfig(level=logging.INFO)
    built = available()
    print(f"CPU kernels: {'built' if built else 'unavailable'} ({_build_dir()})")
    if supported_here() and not built:
        sys.exit("the CPU kernels did not build on a CPU that runs them: see the warning above")
