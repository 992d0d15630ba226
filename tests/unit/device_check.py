"""A TorchFunctionMode that records tensor factory calls made by engine code without an explicit `device=`.

Why: on a GPU, `torch.zeros(n)` / `torch.tensor(ids)` land on the host, and the step then either crashes
("Expected all tensors to be on the same device") or silently pays a host round trip. CPU CI has no second
device to catch that, so the test runs steps under this mode and fails on any implicit factory. Host staging
that is deliberate says `device="cpu"` and then moves with `.to(device)`, and passes. `*_like` and `new_*`
inherit their source's device and are not checked; library code (torch, transformers, xgrammar) is not ours.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch
from torch.overrides import TorchFunctionMode

ENGINE_DIR = Path(__file__).resolve().parents[2] / "engine"

FACTORIES = frozenset({
    torch.tensor, torch.as_tensor, torch.scalar_tensor, torch.zeros, torch.ones, torch.full, torch.empty,
    torch.empty_strided, torch.arange, torch.range, torch.linspace, torch.logspace, torch.eye, torch.rand,
    torch.randn, torch.randint, torch.randperm, torch.tril_indices, torch.triu_indices,
})


def _engine_caller() -> str | None:
    """'engine/<file>:<line>' of the nearest engine frame that made the call, or None when it is not ours."""
    frame = sys._getframe(2)
    torch_dir = str(Path(torch.__file__).parent)
    while frame is not None and frame.f_code.co_filename.startswith(torch_dir):
        frame = frame.f_back
    if frame is None:
        return None
    path = Path(frame.f_code.co_filename)
    if ENGINE_DIR not in path.parents:
        return None
    return f"engine/{path.relative_to(ENGINE_DIR)}:{frame.f_lineno}"


class ImplicitDeviceFactories(TorchFunctionMode):
    """Records `engine/<file>:<line> torch.<factory>` for each engine factory call without `device=`."""

    def __init__(self) -> None:
        super().__init__()
        self.found: list[str] = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        # as_tensor of a tensor keeps that tensor's device: not an implicit host tensor
        keeps_device = func is torch.as_tensor and bool(args) and isinstance(args[0], torch.Tensor)
        if func in FACTORIES and "device" not in kwargs and not keeps_device:
            where = _engine_caller()
            if where is not None:
                self.found.append(f"{where} torch.{func.__name__}")
        return func(*args, **kwargs)


# reads that wait for the device when the tensor lives there
_READS = frozenset({torch.Tensor.item, torch.Tensor.tolist, torch.Tensor.__bool__, torch.Tensor.__int__,
                    torch.Tensor.__float__, torch.Tensor.__index__, torch.Tensor.numpy, torch.Tensor.cpu})
_HOST_TAG = "_sie_host_staged"


class HostReads(TorchFunctionMode):
    """Records each engine read of a tensor's values on the host (`.item()`, `.tolist()`, `bool(t)`, ...): on a
    GPU each one waits for every queued kernel. Tensors the engine made on the host on purpose (a factory with
    `device="cpu"`) are tagged and their reads are free, so only reads of device-side results are counted."""

    def __init__(self) -> None:
        super().__init__()
        self.reads: list[str] = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        result = func(*args, **kwargs)
        if func in FACTORIES and str(kwargs.get("device")) == "cpu" and isinstance(result, torch.Tensor):
            setattr(result, _HOST_TAG, True)
        to_host = func is torch.Tensor.to and any(str(a) == "cpu" for a in (*args[1:], kwargs.get("device")))
        if (func in _READS or to_host) and args and not getattr(args[0], _HOST_TAG, False):
            where = _engine_caller()
            if where is not None:
                self.reads.append(f"{where} {func.__name__}")
        return result
